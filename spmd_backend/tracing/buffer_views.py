"""Buffers that are views of other buffers, traced as views.

A module may register a buffer that shares memory with another (``self.register_buffer("head",
self.table[:8])``: a slice of positional encodings, a window of a running count). The trace lifts
every buffer as its own graph input, which forgets that sharing: an in-place update of the base
did not show in the view's input, and the broadcast DDP does at each forward (``buffer_sync``)
wrote the view's stale copy back over the base's new values after the graph ran (a count updated
through its base lost the update in the viewed half, silently, until 2026-11-28).

:func:`find_buffer_views` maps each buffer whose memory lies inside another buffer's to that
base; the trace then builds the view from the base's traced value (:func:`traced_view`), so
functionalization carries every write through either name to both, only the base is broadcast
and only the base is written back. The map is part of the step's cache key, since ``.data =``
can change what shares memory without replacing a buffer.

Refused (:class:`SpmdUsageError`, before anything runs): two buffers whose memory overlaps without
one holding the other, a view of another dtype, a view where the view or its base is not
contiguous (a column slice), and a buffer sharing memory with a parameter (the parameter is
updated inside the graph, the buffer's copy would be written back over it).

Requires: real tensors. Guarantees: bases are never views themselves (the largest extent wins).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from spmd_backend.errors import SpmdUsageError


def _extent(t: torch.Tensor) -> tuple[int, int] | None:
    """``[start, end)`` in bytes of the memory ``t`` reads, or None for an empty tensor."""
    if t.numel() == 0 or t.device.type == "meta":
        return None
    span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    start = t.data_ptr()
    return start, start + span * t.element_size()


def _name(names: Sequence[tuple[str, ...]], i: int) -> str:
    return names[i][0]


def find_buffer_views(
    buffers: Sequence[torch.Tensor], buffer_names: Sequence[tuple[str, ...]],
    params: Sequence[torch.Tensor] = (), param_names: Sequence[tuple[str, ...]] = (),
) -> tuple[int | None, ...]:
    """For each buffer, the index of the buffer whose memory holds it, or None.

    ``params`` (checked only when given: the trace passes them, a call's key does not) are
    refused as bases."""
    bases: list[int | None] = [None] * len(buffers)
    storages = [b.untyped_storage().data_ptr() for b in buffers]  # 0: no memory
    if params:
        _refuse_parameter_memory(buffers, buffer_names, storages, params, param_names)
    if len(set(storages)) == len(storages):  # no two share an allocation: the common case
        return tuple(bases)
    counts = Counter(s for s in storages if s)
    spans = [(_extent(buffers[i]), i) for i, s in enumerate(storages) if s and counts[s] > 1]
    ordered = sorted(((e[0], -e[1], i) for e, i in spans if e is not None))
    current: tuple[int, int] | None = None  # (end, index) of the open outermost buffer
    for start, neg_end, i in ordered:
        end = -neg_end
        if current is not None and start < current[0]:
            base = current[1]
            if end > current[0]:
                raise SpmdUsageError(
                    f"spmd_backend.compile: buffers {_name(buffer_names, base)!r} and "
                    f"{_name(buffer_names, i)!r} share part of their memory, neither holding the "
                    "other; register one buffer and take the other as a view of it in forward"
                )
            if buffers[i].dtype != buffers[base].dtype:
                raise SpmdUsageError(
                    f"spmd_backend.compile: buffer {_name(buffer_names, i)!r} is a "
                    f"{buffers[i].dtype} view of buffer {_name(buffer_names, base)!r} "
                    f"({buffers[base].dtype}); register one of them and take the other in forward"
                )
            if not (buffers[i].is_contiguous() and buffers[base].is_contiguous()):
                raise SpmdUsageError(
                    f"spmd_backend.compile: buffer {_name(buffer_names, i)!r} is a strided view "
                    f"of buffer {_name(buffer_names, base)!r}; views of buffers are traced when "
                    "both are contiguous (a slice along the first dimension, a reshape). "
                    "Register one of them and take the other in forward, or use "
                    'torch.compile(step, backend="spmd")'
                )
            bases[i] = base
        else:
            current = (end, i)
    return tuple(bases)


def _refuse_parameter_memory(
    buffers: Sequence[torch.Tensor], buffer_names: Sequence[tuple[str, ...]],
    storages: list[int], params: Sequence[torch.Tensor], param_names: Sequence[tuple[str, ...]],
) -> None:
    held = {s: [] for s in storages if s}
    for i, s in enumerate(storages):
        if s:
            held[s].append(i)
    for j, p in enumerate(params):
        pe = _extent(p)
        if pe is None:
            continue
        for i in held.get(p.untyped_storage().data_ptr(), ()):
            e = _extent(buffers[i])
            if e is not None and e[0] < pe[1] and pe[0] < e[1]:
                raise SpmdUsageError(
                    f"spmd_backend.compile: buffer {_name(buffer_names, i)!r} shares memory with "
                    f"parameter {_name(param_names, j)!r}; the step updates the parameter inside "
                    "its graph and would write the buffer's copy back over it. Register a copy "
                    "(`.clone()`), or take the view of the parameter in forward"
                )


def traced_view(base_value: torch.Tensor, base: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """``view`` (a real contiguous buffer inside the real contiguous buffer ``base``) built from
    ``base``'s traced value with view ops relative to it (flatten, narrow, view), never an
    absolute ``as_strided``: a pass may give the base another place in memory (the coalesced
    buffer broadcast makes it a slice of one flat tensor)."""
    offset = view.storage_offset() - base.storage_offset()
    return base_value.view(-1).narrow(0, offset, view.numel()).view(view.shape)


__all__ = ["find_buffer_views", "traced_view"]
