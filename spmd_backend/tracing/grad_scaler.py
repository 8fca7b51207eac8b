"""``torch.amp.GradScaler`` inside a traced step: its state lifted, its skip made a select.

Eager ``scaler.step(opt)`` decides on the host whether to run ``opt.step()``
(``found_inf.item()``), which a graph cannot do. During a trace, for every GradScaler the step
uses (:func:`~spmd_backend.tracing.binding.find_grad_scalers`):

* its ``_scale`` and ``_growth_tracker`` are replaced by the lifted graph inputs (updated in
  place by ``scaler.update()`` and written back like any other state);
* for an optimizer that unscales inside its kernel (``_step_supports_amp_scaling``: the fused
  ones), the scaler's own path already passes ``grad_scale``/``found_inf`` tensors to the
  kernel, which skips the update on the device;
* for every other optimizer, ``opt.step()`` always runs and every parameter and existing state
  tensor is then reset with ``torch.where(found_inf, old, new)``: the step is a select on
  ``found_inf`` with eager's result either way. State the step *creates* cannot be un-created
  in a graph; the step's ``found_inf`` becomes a graph output and the first-step (bootstrap)
  graph's commit drops the created state when it is set, as eager never creates it then.

Scaler, unscale and update ops are annotated with the optimizer phase. Everything is restored
in a ``finally`` block.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from spmd_backend.errors import SpmdUsageError
from spmd_backend.tracing.dispatch import TraceContext


class SkipFlag:
    """Holds the ``found_inf`` tensor of a traced non-fused ``scaler.step`` (None if none ran)."""

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None


def _state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors: list[torch.Tensor] = []
    for group in optimizer.param_groups:
        tensors.extend(group["params"])
    for entries in optimizer.state.values():
        tensors.extend(v for v in entries.values() if isinstance(v, torch.Tensor))
    return tensors


def _selecting_opt_step(skip_flag: SkipFlag) -> Any:
    def maybe_opt_step(optimizer: torch.optim.Optimizer, optimizer_state: dict[str, Any],
                       *args: Any, **kwargs: Any) -> Any:
        found = sum(v.to(torch.float32) for v in optimizer_state["found_inf_per_device"].values())
        with torch.no_grad():
            before = [(t, t.clone()) for t in _state_tensors(optimizer)]
        retval = optimizer.step(*args, **kwargs)
        with torch.no_grad():
            skip = found > 0
            for t, old in before:
                t.copy_(torch.where(skip, old, t))
        skip_flag.value = found if skip_flag.value is None else skip_flag.value + found
        return retval

    return maybe_opt_step


def _in_optimizer_phase(method: Any, ctx: TraceContext) -> Any:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        was = ctx.in_optimizer
        ctx.in_optimizer = True
        try:
            return method(*args, **kwargs)
        finally:
            ctx.in_optimizer = was

    return wrapped


@contextlib.contextmanager
def grad_scalers_swapped(
    scalers: Sequence[Any],
    aux_slots: Sequence[tuple[int, str]],
    f_aux: Sequence[torch.Tensor],
    ctx: TraceContext,
    skip_flag: SkipFlag,
) -> Iterator[None]:
    """Point each GradScaler at its lifted tensors and make its skip a select; always restore,
    the per-optimizer records ``unscale_``/``step`` keep until ``update()`` included (until
    2026-11-28 a trace that failed after ``scaler.step`` left a record holding the trace's fake
    ``found_inf``: the user's next ``scaler.update()`` or eager AMP step failed)."""
    saved_attrs = [(scalers[o], name, getattr(scalers[o], name)) for o, name in aux_slots]
    saved_attrs += [(s, "_per_optimizer_states", s._per_optimizer_states) for s in scalers
                    if hasattr(s, "_per_optimizer_states")]
    patched: list[Any] = []
    try:
        for (o, name), t in zip(aux_slots, f_aux):
            setattr(scalers[o], name, t)
        for scaler in scalers:
            patched.append(scaler)
            records = getattr(scaler, "_per_optimizer_states", None)
            if records is not None:  # the trace writes its own
                fresh = copy.copy(records)  # a defaultdict: its factory kept
                fresh.update((k, dict(v)) for k, v in records.items())
                scaler._per_optimizer_states = fresh
            scaler._maybe_opt_step = _selecting_opt_step(skip_flag)
            for method in ("step", "unscale_", "update"):
                setattr(scaler, method, _in_optimizer_phase(getattr(type(scaler), method).__get__(scaler), ctx))
        yield
        _refuse_pending_update(scalers)
    finally:
        for scaler in patched:
            for method in ("_maybe_opt_step", "step", "unscale_", "update"):
                scaler.__dict__.pop(method, None)
        for obj, name, value in saved_attrs:
            setattr(obj, name, value)


def _refuse_pending_update(scalers: Sequence[Any]) -> None:
    """Raise where the traced step ran ``scaler.unscale_``/``scaler.step`` but not
    ``scaler.update()``: the record ``update()`` reads (this step's ``found_inf``) is a value
    of the trace, which no eager ``update()`` after the call can read (until 2026-11-28 it
    failed there with an AttributeError, and every later call failed)."""
    from torch.amp.grad_scaler import OptState

    for scaler in scalers:
        records = getattr(scaler, "_per_optimizer_states", None) or {}
        if any(r.get("stage", OptState.READY) is not OptState.READY for r in records.values()):
            raise SpmdUsageError(
                "the step calls scaler.unscale_() or scaler.step() of a GradScaler but not "
                "scaler.update(): the inf check update() reads is computed inside the compiled "
                "graph, where an update() after the call cannot read it. Call scaler.update() "
                "inside the compiled step, after scaler.step(optimizer); nothing was changed"
            )


def prepare_grad_scalers(scalers: Sequence[Any], device: torch.device) -> None:
    """Create each enabled scaler's lazily made tensors, as its first ``scale()`` would."""
    for scaler in scalers:
        if getattr(scaler, "_enabled", False) and getattr(scaler, "_scale", None) is None:
            scaler._lazy_init_scale_growth_tracker(device)
