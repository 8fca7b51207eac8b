"""The input/output layout of a traced step, and gathering the live tensors for a call.

A :class:`StepLayout` says how the flat graph inputs and outputs map to the live objects of a
call (parameters, buffers, optimizer state, lifted hyper-parameters, existing gradients, tensor
arguments). :func:`plan_inputs` builds the input half for a binding; :func:`gather_inputs`
collects the real tensors of a later call in placeholder order (hyper-parameter tensors are
cached by value, so an unchanged learning rate allocates nothing).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from spmd_backend.tracing.binding import LIFTED_HYPERPARAMETERS, StepBinding


@dataclass
class StepLayout:
    """How the flat graph inputs and outputs map to the live objects of a call."""

    n_params: int
    n_buffers: int
    state_inputs: list[tuple[int, str]]
    hyper_inputs: list[tuple[int, str]]
    grad_inputs: list[int]
    arg_inputs: list[int]
    out_spec: Any = None
    out_leaves: list[tuple[str, Any]] = field(default_factory=list)
    n_user_tensors: int = 0
    state_outputs: list[tuple[int, str]] = field(default_factory=list)
    state_consts: list[tuple[int, str, Any]] = field(default_factory=list)
    state_touched: list[int] = field(default_factory=list)
    grad_outputs: list[int] = field(default_factory=list)
    creates_state: bool = False

    @property
    def n_inputs(self) -> int:
        return (
            self.n_params
            + self.n_buffers
            + len(self.state_inputs)
            + len(self.hyper_inputs)
            + len(self.grad_inputs)
            + len(self.arg_inputs)
        )




def _hyper_tensor(value: Any, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    return torch.tensor(float(value), dtype=torch.get_default_dtype(), device=device)


def gather_hyperparameters(
    optimizer: torch.optim.Optimizer | None, hyper_inputs: Sequence[tuple[int, str]],
    cache: dict[tuple[int, str], tuple[Any, torch.Tensor]] | None = None,
) -> list[torch.Tensor]:
    """The current values of the lifted hyper-parameters, as tensors (cached by value)."""
    out: list[torch.Tensor] = []
    assert optimizer is not None or not hyper_inputs
    for g, k in hyper_inputs:
        group = optimizer.param_groups[g]  # type: ignore[union-attr]
        value = group[k]
        if isinstance(value, torch.Tensor):
            out.append(value)
            continue
        if cache is not None:
            hit = cache.get((g, k))
            if hit is not None and hit[0] == value:
                out.append(hit[1])
                continue
        device = group["params"][0].device if group["params"] else torch.device("cpu")
        t = _hyper_tensor(value, device)
        if cache is not None:
            cache[(g, k)] = (value, t)
        out.append(t)
    return out


def plan_inputs(binding: StepBinding) -> tuple[StepLayout, list[torch.Tensor]]:
    """The input half of the layout and the real tensors to feed, for ``binding``."""
    opt = binding.optimizer
    state_inputs: list[tuple[int, str]] = []
    hyper_inputs: list[tuple[int, str]] = []
    if opt is not None:
        for i, p in enumerate(binding.params):
            st = opt.state.get(p)
            if not st:
                continue
            for k in sorted(st.keys(), key=str):
                if isinstance(st[k], torch.Tensor):
                    state_inputs.append((i, k))
        for g, group in enumerate(opt.param_groups):
            if not group["params"]:
                continue
            for k in sorted(group.keys()):
                if k in LIFTED_HYPERPARAMETERS or (
                    k != "params" and isinstance(group[k], torch.Tensor)
                ):
                    hyper_inputs.append((g, k))
    grad_inputs = [i for i, p in enumerate(binding.params) if p.grad is not None]
    arg_inputs = [j for j, a in enumerate(binding.flat_args) if isinstance(a, torch.Tensor)]
    layout = StepLayout(
        n_params=len(binding.params),
        n_buffers=len(binding.buffers),
        state_inputs=state_inputs,
        hyper_inputs=hyper_inputs,
        grad_inputs=grad_inputs,
        arg_inputs=arg_inputs,
    )
    return layout, gather_inputs(binding, layout)


def gather_inputs(
    binding: StepBinding,
    layout: StepLayout,
    hyper_cache: dict[tuple[int, str], tuple[Any, torch.Tensor]] | None = None,
) -> list[torch.Tensor]:
    """The real tensors, in placeholder order, for one call that matches ``layout``."""
    opt = binding.optimizer
    params = binding.params
    flat: list[torch.Tensor] = list(params)
    flat.extend(binding.buffers)
    if layout.state_inputs:
        state = opt.state  # type: ignore[union-attr]
        flat.extend(state[params[i]][k] for i, k in layout.state_inputs)
    flat.extend(gather_hyperparameters(opt, layout.hyper_inputs, hyper_cache))
    flat.extend(params[i].grad for i in layout.grad_inputs)  # type: ignore[misc]
    args = binding.flat_args
    flat.extend(args[j] for j in layout.arg_inputs)
    return flat

