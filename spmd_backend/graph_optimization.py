"""Seed-compatible face of the graph passes (``torch.distributed._spmd.graph_optimization``).

The decorator :func:`graph_optimization_pass` and its module-level record ``_optimized_func``
(reset it with ``.clear()``) come from :mod:`spmd_backend.pass_manager`; the passes themselves
live one per file in :mod:`spmd_backend.passes`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.fx as fx

from spmd_backend.errors import SpmdPassError
from spmd_backend.graph.utils import find_all_descendants as _descendants
from spmd_backend.pass_manager import _optimized_func, graph_optimization_pass
from spmd_backend.passes import (
    ModuleTarget,
    comm_fusion_with_concat,
    get_all_fused_optimizer_blocks,
    iter_move_grads_and_optimizers,
    remove_copy_from_optimizer,
    schedule_comm_wait,
    split_fused_optimizer,
)


def find_all_descendants(gm: object, parent_nodes: Sequence[fx.Node]) -> list[fx.Node]:
    """``parent_nodes`` and every node that uses them, transitively, in graph order."""
    if not parent_nodes:
        raise SpmdPassError("find_all_descendants: no parent nodes given")
    return _descendants(gm.graph, parent_nodes)  # type: ignore[attr-defined]


__all__ = [
    "ModuleTarget",
    "_optimized_func",
    "comm_fusion_with_concat",
    "find_all_descendants",
    "get_all_fused_optimizer_blocks",
    "graph_optimization_pass",
    "iter_move_grads_and_optimizers",
    "remove_copy_from_optimizer",
    "schedule_comm_wait",
    "split_fused_optimizer",
]
