"""While the compile door traces a step, an optimizer it was not given is refused.

The compile door lifts the parameters, gradients and state of the optimizer among the step's
arguments (:mod:`spmd_backend.tracing.binding`). An optimizer the step reaches another way (a
global ``OPT``, a closure variable of ``make_step(opt)``, an attribute of an object) was traced
on the real parameters, whose ``.grad`` is not the gradient the trace computes: its ``step()``
traced as nothing. Until 2026-11-28 the first call returned normally without stepping (the
reduced gradients left in ``.grad``, 0.025 off DDP after one step) and the second raised an
error about a captured tensor that did not name the optimizer.

:func:`refuse_unbound_optimizers` (a context manager around the trace) makes ``step()`` and
``zero_grad()`` of any other optimizer raise :class:`~spmd_backend.errors.SpmdUsageError`
naming it, before it touches anything; the trace fails, so nothing of the call has run.

Requires: torch's global optimizer step pre-hooks
(``torch.optim.optimizer.register_optimizer_step_pre_hook``). Guarantees: the bound optimizer
(``None`` when the step was given none) and any optimizer that holds none of the module's real
parameters (one the step makes itself holds the traced stand-ins) are untouched; the hook and
the patch are removed on exit.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from spmd_backend.errors import SpmdUsageError
from spmd_backend.tracing.errors import user_frame
from spmd_backend.tracing.key import INTERNAL_HOOK_ATTR


def _refusal(optimizer: torch.optim.Optimizer, method: str, bound: bool) -> SpmdUsageError:
    where = user_frame(traceback.extract_stack()[:-2])
    at = f" (at {where})" if where else ""
    given = ("the step was given another optimizer" if bound
             else "the step was given no optimizer")
    return SpmdUsageError(
        f"spmd_backend.compile: the step calls {type(optimizer).__name__}.{method}() of an "
        f"optimizer it was not given as an argument{at} ({given}): the compiled step lifts the "
        "state of the optimizer passed to it, and one reached through a global, a closure "
        "variable or an attribute would step parameters the trace does not update. Pass the "
        "optimizer to the step (step(model, optim, batch)), or compile the step with "
        'torch.compile(step, backend="spmd"), which follows it; nothing of this call has run'
    )


def _holds(optimizer: torch.optim.Optimizer, real: set[int]) -> bool:
    return any(id(p) in real for g in optimizer.param_groups for p in g["params"])


@contextlib.contextmanager
def refuse_unbound_optimizers(bound: torch.optim.Optimizer | None,
                              params: Iterable[torch.Tensor]) -> Iterator[None]:
    """While active, ``step()``/``zero_grad()`` of an optimizer other than ``bound`` that holds
    one of ``params`` (the module's real parameters) raise. An optimizer the step makes itself
    (``torch.optim.SGD(model.parameters())`` inside the step) holds the traced stand-ins and is
    traced like any other code."""
    real = {id(p) for p in params}

    def pre_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if optimizer is not bound and _holds(optimizer, real):
            raise _refusal(optimizer, "step", bound is not None)

    original = torch.optim.Optimizer.zero_grad

    def zero_grad(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        if self is not bound and _holds(self, real):
            raise _refusal(self, "zero_grad", bound is not None)
        return original(self, *args, **kwargs)

    setattr(pre_step, INTERNAL_HOOK_ATTR, True)  # not the user's (messages that count hooks)
    handle = register_optimizer_step_pre_hook(pre_step)
    torch.optim.Optimizer.zero_grad = zero_grad  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.optim.Optimizer.zero_grad = original  # type: ignore[method-assign]
        handle.remove()


__all__ = ["refuse_unbound_optimizers"]
