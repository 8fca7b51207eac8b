"""Buffers the traced step rebinds instead of updating in place.

``self.avg = 0.9 * self.avg + 0.1 * x.mean()`` is an ordinary way to keep a running value, and
under eager and DDP the module holds the new tensor afterwards. The compile-door trace runs the
step with the module reparametrized to the lifted buffers, and torch puts the original buffers
back when the trace ends, so such a rebinding used to vanish with the trace: every run
computed from the buffer's first value and left it there, silently (0.89 off DDP after four
steps of an EMA).

:func:`write_rebound_buffers` runs at the end of the traced step, inside the
reparametrization. For each buffer whose module now holds another tensor, it writes that tensor
into the lifted buffer (``copy_``, or ``clone(out=)`` when the shape changed, as torch's
fused observers resize theirs), which the trace records as a mutation of that buffer: the runs write
it back after the graph succeeded, like an in-place update. The buffer keeps its identity (a
reference the user holds to the old tensor sees the new values), and the module is pointed back
at the lifted buffer so that the rest of the trace sees one tensor.

Refused before the graph exists, with :class:`~spmd_backend.errors.SpmdUsageError` naming the
buffer: a rebinding to ``None`` or a deletion, to another dtype (a write-back would round it),
and of a buffer that shares memory with another or is registered under several names (a
rebinding ends the sharing in eager, a write-back could not).

Requires: called inside ``stateless._reparametrize_module`` with the mapping the trace built.
Guarantees: touches only the lifted buffers and the reparametrized modules' ``_buffers``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn

from spmd_backend.errors import SpmdUsageError
from spmd_backend.tracing.buffer_views import View

_MISSING = object()


def _refuse(name: str, problem: str) -> SpmdUsageError:
    return SpmdUsageError(
        f"spmd_backend.compile: buffer '{name}' {problem}. A compiled step can replay "
        "a buffer rebound to a new tensor the step computed (`self.avg = 0.9 * self.avg + ...`) "
        "of the buffer's dtype; update it in place (`self.avg.mul_(0.9).add_(...)`) or keep "
        "its dtype. Nothing was changed."
    )


def write_rebound_buffers(
    module: nn.Module,
    buffer_names: Sequence[tuple[str, ...]],
    lifted: Sequence[torch.Tensor],
    views: Sequence[View | None],
) -> list[str]:
    """Write each rebound buffer's new tensor into its lifted buffer; return the names written
    (for the trace log). ``views[j]``: the buffer whose memory holds buffer ``j`` and the
    offset there, or None (:func:`~spmd_backend.tracing.buffer_views.find_buffer_views`)."""
    bases = {v[0] for v in views if v is not None}
    written: list[str] = []
    for j, (names, fb) in enumerate(zip(buffer_names, lifted)):
        for name in names:
            prefix, _, leaf = name.rpartition(".")
            owner = module.get_submodule(prefix)
            now = owner._buffers.get(leaf, _MISSING)
            if now is fb:
                continue
            if now is _MISSING or now is None:
                raise _refuse(name, "is deleted by the step" if now is _MISSING
                              else "is set to None by the step")
            if not isinstance(now, torch.Tensor) or now.dtype != fb.dtype:
                got = now.dtype if isinstance(now, torch.Tensor) else type(now).__name__
                raise _refuse(name, f"is rebound by the step to a {got} value (it was {fb.dtype})")
            # a rebinding unties a view, its base or a second name in eager
            if views[j] is not None or j in bases or len(names) > 1:
                shared = (f"is registered under {len(names)} names" if len(names) > 1
                          else "shares memory with another buffer")
                raise _refuse(name, f"{shared} and is rebound by the step")
            with torch.no_grad():
                if now.shape != fb.shape:  # an out= op: a data write that may resize
                    torch.ops.aten.clone.out(now, out=fb)
                else:
                    fb.copy_(now)
            owner._buffers[leaf] = fb
            written.append(name)
    return written
