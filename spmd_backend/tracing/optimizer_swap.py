"""Point an optimizer at the lifted tensors for a trace, in its traceable (capturable) form.

:func:`optimizer_swapped` replaces each param group's parameters, the optimizer state and the
lifted hyper-parameters by the trace's functional tensors, turns on ``capturable`` (tensor math,
no ``.item()`` on step counts), traces an unspecified implementation as fused where the kernel
can run it, and reports ``torch.compiler.is_compiling()`` while ``step()`` runs. Everything is
restored in a ``finally`` block.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from spmd_backend.tracing.dispatch import TraceContext


@contextlib.contextmanager
def optimizer_swapped(
    opt: torch.optim.Optimizer,
    f_params: list[torch.Tensor],
    index: dict[int, int],
    f_state: dict[int, dict[str, Any]],
    f_hyper: dict[tuple[int, str], torch.Tensor],
    ctx: TraceContext,
) -> Iterator[collections.defaultdict]:
    """Point the optimizer at the lifted tensors for the trace; always restore it."""
    saved_groups = [dict(g) for g in opt.param_groups]
    saved_state = opt.state
    new_state: collections.defaultdict = collections.defaultdict(dict)
    for i, entries in f_state.items():
        new_state[f_params[i]] = dict(entries)
    saved_flag = torch.compiler._is_compiling_flag

    def pre_hook(*_: object) -> None:
        ctx.in_optimizer = True
        torch.compiler._is_compiling_flag = True

    def post_hook(*_: object) -> None:
        ctx.in_optimizer = False
        torch.compiler._is_compiling_flag = saved_flag

    handles = [opt.register_step_pre_hook(pre_hook), opt.register_step_post_hook(post_hook)]
    try:
        for g, group in enumerate(opt.param_groups):
            group["params"] = [f_params[index[id(p)]] for p in group["params"]]
            for (hg, k), t in f_hyper.items():
                if hg == g:
                    group[k] = t
            if "capturable" in group:
                group["capturable"] = True
            if _can_default_to_fused(group):
                group["fused"] = True
        opt.state = new_state
        yield new_state
    finally:
        for h in handles:
            h.remove()
        ctx.in_optimizer = False
        torch.compiler._is_compiling_flag = saved_flag
        opt.state = saved_state
        for group, saved in zip(opt.param_groups, saved_groups):
            group.clear()
            group.update(saved)


def _fused_supported_devices() -> list[str]:
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    return _get_fused_kernels_supported_devices()


def _can_default_to_fused(group: dict[str, Any]) -> bool:
    """True when a group left the implementation to torch and the fused kernel can run it.

    torch picks the single-tensor loop on CPU for eager speed; in a compiled graph one fused
    kernel is both faster and far cheaper to trace, so an unspecified implementation is traced
    as fused where the kernel supports every parameter. Explicit choices are respected.
    """
    if "fused" not in group or group.get("fused") is not None or group.get("foreach") is not None:
        return False
    if group.get("differentiable"):
        return False
    supported = _fused_supported_devices()
    return all(
        torch.is_floating_point(p) and p.device.type in supported for p in group["params"]
    )

