"""split_fused_optimizer: split one optimizer block into two over a subset of its gradients.

Requires: an :class:`~spmd_backend.graph.optim.OptimizerBlock` of the graph (fused Adam/AdamW/
SGD or a foreach chain, functional or in-place). Guarantees: the block's list ops are replaced
by two ops each, one over the parameters whose gradient is in ``split_gradients`` and one over
the rest, computing exactly what the one block did (the surgery, its guarantees and a
before/after sketch: :mod:`spmd_backend.graph.optim_surgery`). Returns the two new blocks (the
second is ``None`` when every gradient was selected); raises
:class:`~spmd_backend.errors.SpmdPassError` when no given gradient is read by the block. The
blocks can then be moved independently.

The pass always has a pattern: the caller names the block, as the upstream API does
(``get_all_fused_optimizer_blocks(gm, "_fused_adam")[0]``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch.fx as fx

from spmd_backend.graph.optim import OptimizerBlock
from spmd_backend.graph.optim_surgery import split_optimizer_block
from spmd_backend.pass_manager import declare_pass

log = logging.getLogger(__name__)


def split_fused_optimizer(
    gm: object, orig_optim_block: OptimizerBlock, split_gradients: Iterable[fx.Node]
) -> tuple[OptimizerBlock, OptimizerBlock | None]:
    """Split ``orig_optim_block`` over ``split_gradients`` (see the module docstring)."""
    selected, rest = split_optimizer_block(gm, orig_optim_block, split_gradients)
    if rest is None:
        log.info(
            "split_fused_optimizer: every gradient of %s is selected; nothing to split",
            orig_optim_block.optim.optim_node.name,
        )
    return selected, rest


declare_pass(split_fused_optimizer)
