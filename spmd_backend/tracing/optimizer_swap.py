"""Point an optimizer at the lifted tensors for a trace, in its traceable (capturable) form.

:func:`optimizer_swapped` replaces each param group's parameters, the optimizer state and the
lifted hyper-parameters by the trace's functional tensors, turns on ``capturable`` (tensor math,
no ``.item()`` on step counts), traces an unspecified implementation as fused where the kernel
can run it, and marks the optimizer phase while ``step()`` runs. Each param group is replaced
by a :class:`~spmd_backend.tracing.tracked.RecordingGroup`, so the keys the step reads become the
graph's guards. Everything (the user's group dicts included) is restored in a ``finally`` block.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from spmd_backend.tracing.dispatch import TraceContext
from spmd_backend.tracing.hyperparams import HyperSlot, install
from spmd_backend.tracing.tracked import ReadRecorder, RecordingGroup


@contextlib.contextmanager
def optimizer_swapped(
    opt: torch.optim.Optimizer,
    f_params: list[torch.Tensor],
    index: dict[int, int],
    f_state: dict[int, dict[str, Any]],
    f_hyper: dict[HyperSlot, torch.Tensor],
    ctx: TraceContext,
    recorder: ReadRecorder,
) -> Iterator[collections.defaultdict]:
    """Point the optimizer at the lifted tensors for the trace; always restore it."""
    saved_groups = list(opt.param_groups)
    saved_state = opt.state
    new_state: collections.defaultdict = collections.defaultdict(dict)
    for i, entries in f_state.items():
        new_state[f_params[i]] = dict(entries)

    def pre_hook(*_: object) -> None:
        ctx.in_optimizer = True

    def post_hook(*_: object) -> None:
        ctx.in_optimizer = False

    handles = [opt.register_step_pre_hook(pre_hook), opt.register_step_post_hook(post_hook)]
    try:
        for g, group in enumerate(saved_groups):
            swapped = dict(group)
            swapped["params"] = [f_params[index[id(p)]] for p in group["params"]]
            for slot, t in f_hyper.items():
                if slot[0] == g:
                    install(swapped, slot, t)
            if "capturable" in swapped:
                swapped["capturable"] = True
            if _can_default_to_fused(type(opt), group):
                swapped["fused"] = True
            opt.param_groups[g] = RecordingGroup(
                swapped, lambda k, _g=g: recorder.read_group_key(_g, k)
            )
        opt.state = new_state
        yield new_state
    finally:
        for h in handles:
            h.remove()
        ctx.in_optimizer = False
        opt.state = saved_state
        opt.param_groups[:] = saved_groups


def _fused_supported_devices() -> list[str]:
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    return _get_fused_kernels_supported_devices()


#: optimizer classes whose fused kernel traces (meta kernels: spmd_backend.tracing.fused_optim)
FUSED_BY_DEFAULT: frozenset[str] = frozenset({"Adam", "AdamW", "SGD"})


def _can_default_to_fused(cls: type, group: dict[str, Any]) -> bool:
    """True when a group left the implementation to torch and the fused kernel can run it.

    torch picks the single-tensor loop on CPU for eager speed; in a compiled graph one fused
    kernel is both faster and far cheaper to trace, so an unspecified implementation is traced
    as fused where the kernel supports every parameter and traces (:data:`FUSED_BY_DEFAULT`).
    Explicit choices are respected.
    """
    if cls.__name__ not in FUSED_BY_DEFAULT or not cls.__module__.startswith("torch.optim"):
        return False
    if "fused" not in group or group.get("fused") is not None or group.get("foreach") is not None:
        return False
    if group.get("differentiable"):
        return False
    supported = _fused_supported_devices()
    return all(
        torch.is_floating_point(p) and p.device.type in supported for p in group["params"]
    )

