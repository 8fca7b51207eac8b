"""Keep eager's layout where Inductor would turn a concatenation into a layout-preserving copy.

A step graph is already aten: every ``view`` in it was decided on the strides eager (and the
fake tensors that traced it) gave each tensor. ``compile_fx`` re-traces the graph with
Inductor's decompositions, and in torch 2.13 its ``aten.cat`` decomposition drops empty inputs
(a legacy 1-D ``torch.tensor([])``, or an input of size 0 along ``dim``) and, when one tensor is
left, returns ``clone()`` of it: the clone keeps that tensor's strides, where eager's ``cat``
allocates its output in the inputs' memory format (contiguous for a transposed input). A later
``view`` of the result that was valid on eager's layout then fails the re-trace ("Cannot view a
tensor with shape ... and strides ...") and the whole step runs as the fx graph. transformers'
key/value cache starts as an empty 1-D tensor and is concatenated with each layer's transposed
keys, so T5 (its decoder keeps the cache while training) and GPT-2 with attention dropout fell
back this way on every step (2026-11-28).

:func:`keep_cat_layouts` rewrites each such ``cat`` (one input left after Inductor's filtering)
into a copy of that input in the memory format of the ``cat``'s traced result, which is what the
rest of the graph was traced against. For lowering only, on the flat copy Inductor compiles.

Requires: ``meta["val"]`` on the ``cat`` node and its inputs (nodes without one are left alone).
Guarantees: the values are unchanged (a ``cat`` of one tensor is a copy of it); the copy has the
traced result's strides whenever those are a memory format's; anything else is left as is.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.fx as fx

from spmd_backend.graph import meta, ops

log = logging.getLogger(__name__)

_FORMATS = (torch.contiguous_format, torch.channels_last, torch.channels_last_3d)


def _is_zero(size: Any) -> bool:
    """Whether a size is 0 for certain (a symbolic size is never assumed to be)."""
    return isinstance(size, int) and size == 0


def _dropped(value: torch.Tensor, dim: int) -> bool:
    """Whether Inductor's ``cat`` decomposition drops this input (torch 2.13's rule)."""
    if value.dim() == 1 and _is_zero(value.shape[0]):
        return True
    return dim < value.dim() and _is_zero(value.shape[dim])


def _memory_format(value: torch.Tensor) -> torch.memory_format | None:
    for fmt in _FORMATS:
        try:
            if value.is_contiguous(memory_format=fmt):
                return fmt
        except RuntimeError:  # channels_last of a tensor of another rank
            continue
    return None


def keep_cat_layouts(gm: fx.GraphModule) -> int:
    """Rewrite the graph's one-input-left ``cat`` nodes (see the module docstring); returns how
    many were rewritten."""
    rewritten = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in ops.CAT_TARGETS:
            continue
        tensors = node.args[0]
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        out = node.meta.get("val")
        values = [t.meta.get("val") if isinstance(t, fx.Node) else None for t in tensors]
        if not isinstance(out, torch.Tensor) or not all(isinstance(v, torch.Tensor) for v in values):
            continue
        kept = [t for t, v in zip(tensors, values) if not _dropped(v, dim)]
        fmt = _memory_format(out)
        if len(kept) != 1 or fmt is None:
            continue
        source = kept[0].meta["val"]
        with gm.graph.inserting_before(node):
            if source.dtype == out.dtype:
                copy = gm.graph.call_function(torch.ops.aten.clone.default, (kept[0],),
                                              {"memory_format": fmt})
            else:
                copy = gm.graph.call_function(torch.ops.aten._to_copy.default, (kept[0],),
                                              {"dtype": out.dtype, "memory_format": fmt})
        meta.inherit(copy, node)
        copy.meta["val"] = out
        node.replace_all_uses_with(copy)
        gm.graph.erase_node(node)
        rewritten += 1
    if rewritten:
        gm.recompile()
        log.debug("keep_cat_layouts: %d concatenation(s) of one tensor copied in eager's layout",
                  rewritten)
    return rewritten


__all__ = ["keep_cat_layouts"]
