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
and only the base is written back. The map (base and offset of each view) is part of the
step's cache key, since ``.data =`` can change what shares memory, or where, without replacing
a buffer.

Refused (:class:`SpmdUsageError`, before anything runs): two buffers whose memory overlaps without
one holding the other, a view of another dtype, a view where the view or its base is not
contiguous (a column slice), a buffer sharing memory with a parameter (the parameter is
updated inside the graph, the buffer's copy would be written back over it), and a tensor
argument sharing memory with a buffer or parameter.

Requires: real tensors. Guarantees: bases are never views themselves (the largest extent wins).
The common case (no two buffers share an allocation, none shares a parameter's) costs one
storage lookup per buffer and parameter per call.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

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


#: a view's place: the index of the buffer that holds it and its offset in elements from the
#: base's first element
View = tuple[int, int]

#: results for layouts that had shared memory, by the sharing buffers' storage, offset, shape,
#: stride and dtype (a model with many views of one table, per-layer slices of rotary codes,
#: paid ~2 us a buffer per call for the sweep)
_SEEN: dict[tuple, tuple[View | None, ...]] = {}
_SEEN_LIMIT = 64


def find_buffer_views(
    buffers: Sequence[torch.Tensor], buffer_names: Sequence[tuple[str, ...]],
    params: Sequence[torch.Tensor], param_names: Sequence[tuple[str, ...]],
    args: Sequence[Any] = (), arg_labels: Callable[[], list[str]] | None = None,
) -> tuple[View | None, ...]:
    """For each buffer, where it lies inside another buffer (:data:`View`), or None. Raises
    :class:`SpmdUsageError` for sharing the trace cannot reproduce (see the module docstring),
    a tensor among ``args`` sharing a buffer's or parameter's memory included
    (``step(model, opt, x, model.count)``: two graph inputs, each written back on its own, left
    neither as eager does; ``arg_labels()`` names them, computed only to raise).

    Every call's key holds the result, so a ``.data =`` that moves a view, or makes a buffer
    share a parameter's memory, retraces (and is checked) instead of replaying the old layout.
    """
    storages = [b.untyped_storage().data_ptr() for b in buffers]  # 0: no memory
    owned = {p.untyped_storage().data_ptr() for p in params}
    owned.discard(0)
    for j, a in enumerate(args):
        if isinstance(a, torch.Tensor) and (ptr := a.untyped_storage().data_ptr()) \
                and (ptr in owned or ptr in storages):
            _refuse_argument(j, a, arg_labels, buffers, buffer_names, params, param_names)
    unique = len(set(storages)) == len(storages)
    if unique and owned.isdisjoint(storages):  # the common case: nothing shares memory
        return (None,) * len(buffers)
    if not owned.isdisjoint(storages):
        _refuse_parameter_memory(buffers, buffer_names, storages, params, param_names)
    if unique:
        return (None,) * len(buffers)
    counts = Counter(s for s in storages if s)
    shared = [i for i, s in enumerate(storages) if s and counts[s] > 1]
    signature = tuple((i, storages[i], buffers[i].storage_offset(), buffers[i].shape,
                       buffers[i].stride(), buffers[i].dtype) for i in shared)
    found = _SEEN.get(signature)
    if found is None or len(found) != len(buffers):
        found = _sweep(buffers, buffer_names, shared)
        if len(_SEEN) >= _SEEN_LIMIT:
            _SEEN.clear()
        _SEEN[signature] = found
    return found


def _sweep(buffers: Sequence[torch.Tensor], buffer_names: Sequence[tuple[str, ...]],
           shared: list[int]) -> tuple[View | None, ...]:
    views: list[View | None] = [None] * len(buffers)
    spans = [(_extent(buffers[i]), i) for i in shared]
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
            views[i] = (base, buffers[i].storage_offset() - buffers[base].storage_offset())
        else:
            current = (end, i)
    return tuple(views)


def _refuse_argument(
    j: int, arg: torch.Tensor, labels: Callable[[], list[str]] | None,
    buffers: Sequence[torch.Tensor], buffer_names: Sequence[tuple[str, ...]],
    params: Sequence[torch.Tensor], param_names: Sequence[tuple[str, ...]],
) -> None:
    """Raise for argument ``j``, naming the buffer or parameter it is (else shares memory with)."""
    ptr = arg.untyped_storage().data_ptr()
    state = [("buffer", t, n[0]) for t, n in zip(buffers, buffer_names)]
    state += [("parameter", t, n[0]) for t, n in zip(params, param_names)]
    kind, name = next(((k, n) for k, t, n in state if t is arg), None) or next(
        (k, n) for k, t, n in state if t.untyped_storage().data_ptr() == ptr)
    label = labels()[j] if labels is not None else f"#{j}"
    raise SpmdUsageError(
        f"spmd_backend.compile: argument {label} shares memory with the module's {kind} "
        f"{name!r}; the step would read and write them as two tensors. Let the step reach it "
        f"through the module (model.{name}), or pass a copy"
    )


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


def traced_view(base_value: torch.Tensor, offset: int, view: torch.Tensor) -> torch.Tensor:
    """``view`` (a real contiguous buffer ``offset`` elements into a contiguous base) built
    from the base's traced value with view ops relative to it (flatten, narrow, view), never an
    absolute ``as_strided``: a pass may give the base another place in memory (the coalesced
    buffer broadcast makes it a slice of one flat tensor)."""
    return base_value.view(-1).narrow(0, offset, view.numel()).view(view.shape)


__all__ = ["View", "find_buffer_views", "traced_view"]
