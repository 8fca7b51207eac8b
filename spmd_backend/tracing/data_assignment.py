"""``tensor.data = other`` inside a step that the compile door traces becomes ``copy_``.

Assigning ``.data`` swaps a tensor's storage without any aten op, so make_fx never sees it: a
traced step dropped it silently (the reference SAM optimizer restores each parameter with
``p.data = self.state[p]["old_p"]`` after its perturbation; the compiled step kept the
perturbed weights and trained 5-8% off DDP). While a step is traced,
:func:`data_assignment_as_copy` gives ``torch.Tensor`` a ``data`` property whose setter writes
``other`` into the tensor with ``copy_`` under ``no_grad`` (what the assignment does to the
tensor's values, outside autograd), so the graph carries it. What the copy does not reproduce is
the aliasing: afterwards the two tensors do not share storage, so a step that goes on to
mutate ``other`` in place and expects the assigned tensor to follow would differ (none of the
optimizers or models tested does). An assignment that changes the shape, dtype or device is
refused with :class:`~spmd_backend.errors.SpmdUsageError` (a graph input cannot change them).

Requires: nothing. Guarantees: ``torch.Tensor.data`` is torch's own again when the context
exits; reading ``.data`` is unchanged inside it.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator
from typing import Any

import torch

from spmd_backend.errors import SpmdUsageError
from spmd_backend.tracing.errors import user_frame

_BASE = torch._C.TensorBase.data


def _get(self: torch.Tensor) -> torch.Tensor:
    return _BASE.__get__(self)


def _set(self: torch.Tensor, value: torch.Tensor) -> None:
    if (value.shape, value.dtype, value.device) != (self.shape, self.dtype, self.device):
        where = user_frame(traceback.extract_stack()[:-1])
        raise SpmdUsageError(
            "spmd_backend.compile: the train step assigns tensor.data a tensor of another "
            f"shape, dtype or device ({tuple(self.shape)} {self.dtype} {self.device} -> "
            f"{tuple(value.shape)} {value.dtype} {value.device})"
            + (f" at {where}" if where else "")
            + "; a compiled step cannot change its inputs' layout. Do it outside the step."
        )
    with torch.no_grad():
        self.copy_(value)


@contextlib.contextmanager
def data_assignment_as_copy() -> Iterator[None]:
    """While active, ``t.data = other`` is ``t.copy_(other)`` (see the module doc)."""
    had = "data" in vars(torch.Tensor)
    saved: Any = vars(torch.Tensor).get("data")
    torch.Tensor.data = property(_get, _set)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        if had:
            torch.Tensor.data = saved  # type: ignore[method-assign]
        else:
            del torch.Tensor.data
