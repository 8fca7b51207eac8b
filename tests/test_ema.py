"""An exponential moving average of the weights updated inside the step (timm's ModelEmaV2,
diffusion training loops): through both doors it matches eager on one process (fake group,
``reduce_op="sum"``, so the collectives change nothing).

The compile door takes the EMA weights as an argument (a list of tensors: the step's one
module is the model); the Dynamo door also takes them from the enclosing scope.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import spmd_backend
from spmd_backend import SpmdTraceError


def _models():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    return model, copy.deepcopy(model).requires_grad_(False)


def _step(model, opt, x, ema_params, foreach):
    opt.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    with torch.no_grad():
        if foreach:  # timm's form
            torch._foreach_lerp_(ema_params, list(model.parameters()), 0.1)
        else:
            for e, p in zip(ema_params, model.parameters()):
                e.mul_(0.9).add_(p, alpha=0.1)
    return loss


def _check(compiled_call, foreach):
    model, ema = _models()
    twin, twin_ema = copy.deepcopy(model), copy.deepcopy(ema)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    for i in range(4):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(i))
        compiled_call(model, opt, x, ema)
        _step(twin, twin_opt, x, list(twin_ema.parameters()), foreach)
    for a, b in zip(ema.parameters(), twin_ema.parameters()):
        torch.testing.assert_close(a, b)
    assert not torch.equal(next(ema.parameters()), next(_models()[1].parameters()))


@pytest.mark.parametrize("foreach", [False, True])
def test_compile_door_with_ema_weights_as_an_argument(fake_pg, foreach):
    compiled = spmd_backend.compile()(_step)
    _check(lambda m, o, x, ema: compiled(m, o, x, list(ema.parameters()), foreach), foreach)


def test_compile_door_names_a_captured_ema_module(fake_pg):
    model, ema = _models()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @spmd_backend.compile()
    def step(model, opt, x):
        return _step(model, opt, x, list(ema.parameters()), False)

    with pytest.raises(SpmdTraceError, match=r"as a list: list\(ema.parameters\(\)\)"):
        step(model, opt, torch.randn(2, 8))


@pytest.mark.parametrize("foreach", [False, True])
def test_dynamo_door_with_ema_from_the_enclosing_scope(fake_pg, foreach):
    torch._dynamo.reset()
    holder = {}

    def step(model, opt, x):
        return _step(model, opt, x, list(holder["ema"].parameters()), foreach)

    compiled = torch.compile(step, backend="spmd", options={"inductor": False, "reduce_op": "sum"})

    def call(model, opt, x, ema):
        holder["ema"] = ema
        return compiled(model, opt, x)

    _check(call, foreach)
