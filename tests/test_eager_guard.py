"""A step of ``backend="spmd"`` that Dynamo would run eagerly without calling the backend
(Dynamo disabled, a torch dispatch mode active) is refused before it runs on more than one rank;
under ``no_grad`` and on one rank it runs eagerly, which is exact there
(:mod:`spmd_backend.dynamo.eager_guard`). Single process, fake process group: a refusal shows
as the error and as nothing changed; without the guard the step ran eagerly and changed the
parameters."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

import spmd_backend
from spmd_backend.testing import fake_process_group
from spmd_backend.testing.steps import train_step

FAST = {"inductor": False}


def _model_and_optimizer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _refused(compiled, model, opt, match):
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(spmd_backend.SpmdUsageError, match=match):
        compiled(model, opt, torch.randn(4, 8))
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_a_step_compiled_with_dynamo_disabled_is_refused(fake_pg, monkeypatch, how):
    torch._dynamo.reset()
    model, opt = _model_and_optimizer()
    if how == "environment":
        monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    compiled = torch.compile(train_step, backend="spmd", options=FAST, disable=how == "argument")
    _refused(compiled, model, opt, r"the step 'train_step' would run eagerly \(torch.compile\(disable=True\)")


def test_a_module_compiled_with_dynamo_disabled_is_refused_when_decorated(fake_pg):
    model, _ = _model_and_optimizer()
    with pytest.raises(spmd_backend.SpmdUsageError, match="the module Sequential would run eagerly"):
        torch.compile(model, backend="spmd", disable=True)


def test_a_step_called_with_dynamo_disabled_is_refused(fake_pg):
    torch._dynamo.reset()
    model, opt = _model_and_optimizer()
    compiled = torch.compile(train_step, backend="spmd", options=FAST)
    with torch._dynamo.config.patch(disable=True):
        _refused(compiled, model, opt, r"would run eagerly \(torch._dynamo.config.disable is set\)")


def test_a_step_called_under_a_dispatch_mode_is_refused(fake_pg):
    torch._dynamo.reset()
    model, opt = _model_and_optimizer()
    compiled = torch.compile(train_step, backend="spmd", options=FAST)
    compiled(model, opt, torch.randn(4, 8))  # compiled; the mode makes Dynamo skip the frame
    with FlopCounterMode(display=False):
        _refused(compiled, model, opt, "a torch dispatch mode is active")


def test_an_evaluation_under_no_grad_and_a_one_rank_step_run_eagerly():
    torch._dynamo.reset()
    model, opt = _model_and_optimizer()
    evaluate = torch.compile(lambda m, x: m(x).sum(), backend="spmd", options=FAST, disable=True)
    with fake_process_group(world_size=2):
        with torch.no_grad():
            evaluate(model, torch.randn(4, 8))
    with fake_process_group(world_size=1):
        compiled = torch.compile(train_step, backend="spmd", options=FAST, disable=True)
        before = [p.detach().clone() for p in model.parameters()]
        compiled(model, opt, torch.randn(4, 8))
        assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_other_backends_are_untouched(fake_pg):
    model, opt = _model_and_optimizer()
    assert torch.compile(model, backend="eager", disable=True) is model
    torch.compile(train_step, backend="eager", disable=True)(model, opt, torch.randn(4, 8))


def test_a_step_called_under_the_force_eager_stance_is_refused(fake_pg):
    torch._dynamo.reset()
    model, opt = _model_and_optimizer()
    compiled = torch.compile(train_step, backend="spmd", options=FAST)
    with torch.compiler.set_stance("force_eager"):
        _refused(compiled, model, opt, r'set_stance\("force_eager"\)')
        with torch.no_grad():  # an evaluation runs eagerly, as the stance says
            evaluate = torch.compile(lambda m, x: m(x).sum(), backend="spmd", options=FAST)
            evaluate(model, torch.randn(4, 8))


@pytest.mark.parametrize("stance", ["eager_then_compile", "eager_on_recompile"])
def test_stances_that_run_calls_eagerly_compile_spmd_steps(fake_pg, stance):
    """Such a stance ran the first call (or a recompile) eagerly, unsynchronized."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model, opt = _model_and_optimizer()
    compiled = torch.compile(train_step, backend="spmd", options=FAST)
    with torch.compiler.set_stance(stance), pytest.warns(UserWarning, match=rf'"{stance}"\) is not applied'):
        compiled(model, opt, torch.randn(4, 8))
    assert counters["spmd"]["whole_step_graphs"] == 1, dict(counters["spmd"])
