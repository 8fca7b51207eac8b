"""An exponential moving average of the weights updated inside the step (timm's ModelEmaV2,
diffusion training loops): through both doors it matches eager on one process (fake group,
``reduce_op="sum"``, so the collectives change nothing).

The compile door takes the EMA weights as an argument (a list of tensors: the step's one
module is the model); the Dynamo door also takes them from the enclosing scope. torch's own
``AveragedModel`` (``torch.optim.swa_utils``, torchvision's reference scripts) decides on its
counter's value in ``update_parameters``: the compile door refuses it saying to call it after the
step, the Dynamo door runs it between graphs.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

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


class _WithAverage(nn.Module):
    """A model holding torch's EMA of itself as a submodule (its weights untrained)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _models()[0]
        self.average = AveragedModel(self.net, multi_avg_fn=get_ema_multi_avg_fn(0.9))
        self.average.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _averaged_step(model, opt, x, average):
    loss = _step(model, opt, x, [], False)
    average.update_parameters(model.net)
    return loss


@pytest.mark.parametrize("held", ["submodule", "enclosing scope"])
def test_compile_door_refuses_averaged_model_update_saying_where_to_call_it(fake_pg, held):
    """bool(n_averaged == 0) in update_parameters: the refusal names torch's line and says to
    call it after the step (before, it blamed "the optimizer's step", or advised passing the
    weights as a list, which AveragedModel cannot take), and changes nothing."""
    model = _WithAverage()
    opt = torch.optim.SGD(model.net.parameters(), lr=0.1)
    before = copy.deepcopy(model.state_dict())
    if held == "submodule":
        step = spmd_backend.compile()(lambda m, o, x: _averaged_step(m, o, x, m.average))
    else:
        step = spmd_backend.compile()(lambda m, o, x: _averaged_step(m, o, x, model.average))
    with pytest.raises(SpmdTraceError, match=r"AveragedModel.update_parameters at "
                                             r"torch/optim/swa_utils\.py:\d+ .*n_averaged.*"
                                             r"after the compiled step"):
        step(model, opt, torch.randn(4, 8))
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert all(p.grad is None for p in model.parameters())
    assert not opt.state


def test_dynamo_door_runs_averaged_model_update_like_eager(fake_pg):
    torch._dynamo.reset()
    model, twin = _WithAverage(), _WithAverage()
    twin.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(model.net.parameters(), lr=1e-2)
    twin_opt = torch.optim.AdamW(twin.net.parameters(), lr=1e-2)
    compiled = torch.compile(lambda m, o, x: _averaged_step(m, o, x, m.average), backend="spmd",
                             options={"inductor": False, "reduce_op": "sum"})
    for i in range(4):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(i))
        compiled(model, opt, x)
        _averaged_step(twin, twin_opt, x, twin.average)
    assert int(model.average.n_averaged) == 4
    for (name, a), b in zip(model.state_dict().items(), twin.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)
