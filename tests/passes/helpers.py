"""Shared helpers for the per-pass tests: trace a tiny step under a fake process group and
compare a transformed run with an untransformed one."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn

import spmd_backend
from spmd_backend.iter_graph_module import IterGraphModule


class Net(nn.Module):
    def __init__(self, dims=(16, 32, 32, 8), dtype=torch.float32) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Linear(a, b, dtype=dtype) for a, b in zip(dims[:-1], dims[1:])
        )

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x.to(layer.weight.dtype))
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


def step_fn(model, optim, batch):
    loss = model(batch).float().pow(2).mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def make_optim(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    params = model.parameters()
    return {
        "adam_fused": lambda: torch.optim.Adam(params, lr=0.01, fused=True),
        "adamw_fused": lambda: torch.optim.AdamW(params, lr=0.01, fused=True, weight_decay=0.1),
        "adam_foreach": lambda: torch.optim.Adam(params, lr=0.01, foreach=True),
        "adam_single": lambda: torch.optim.Adam(params, lr=0.01, foreach=False),
        "sgd_momentum": lambda: torch.optim.SGD(params, lr=0.05, momentum=0.9, foreach=False),
        "sgd_foreach": lambda: torch.optim.SGD(params, lr=0.05, momentum=0.9, foreach=True),
        "sgd_fused": lambda: torch.optim.SGD(params, lr=0.05, momentum=0.9, fused=True),
    }[kind]()


def run_pair(
    transformation: Callable[[Any], Any],
    optim_kind: str = "adam_fused",
    steps: int = 4,
    model_factory: Callable[[], nn.Module] = Net,
    last_train_step: bool = True,
    batch_sizes: Sequence[int] = (),
    reduce_op: str = "sum",
    **mode_options: Any,
) -> tuple[Any, nn.Module, nn.Module]:
    """Train the same model with and without ``transformation``; return (compiled, a, b).
    ``batch_sizes``: one per step (default 8 each); ``mode_options``: more ``DataParallel``
    options (``shard_optimizer=True``)."""
    torch.manual_seed(0)
    model = model_factory()
    ref = copy.deepcopy(model)
    opt, ref_opt = make_optim(model, optim_kind), make_optim(ref, optim_kind)
    mode = spmd_backend.DataParallel(reduce_op=reduce_op, **mode_options)
    compiled = spmd_backend.compile(gm_transformation=transformation, parallel_mode=mode)(step_fn)
    plain = spmd_backend.compile(parallel_mode=mode)(step_fn)
    gen = torch.Generator().manual_seed(1)
    for i in range(steps):
        batch = torch.randn(batch_sizes[i] if batch_sizes else 8, 16, generator=gen)
        iterative = isinstance(compiled.compiled, IterGraphModule)
        kwargs = {"last_train_step": True} if last_train_step and iterative and i == steps - 1 else {}
        compiled(model, opt, batch, **kwargs)
        plain(ref, ref_opt, batch)
    return compiled, model, ref


def assert_same_training(model: nn.Module, ref: nn.Module) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, msg=lambda m, name=name: f"{name}: {m}")


def graph_code(gm: Any) -> str:
    graph = gm.graph
    return graph.python_code("self").src
