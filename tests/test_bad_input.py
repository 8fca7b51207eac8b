"""Bad input: a clear error naming the problem, and the user's model and optimizer untouched."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import spmd_backend
from spmd_backend import SpmdDistributedError, SpmdTraceError, SpmdUsageError
from spmd_backend.testing.models import MLP


def snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {
        "params": [(id(p), p.detach().clone(), p.grad) for p in model.parameters()],
        "buffers": [b.clone() for b in model.buffers()],
        "modules": [(n, id(m)) for n, m in model.named_modules()],
        "groups": [(id(g["params"]), [id(p) for p in g["params"]], dict(g)) for g in opt.param_groups],
        "state_obj": id(opt.state),
        "state": {id(k): dict(v) for k, v in opt.state.items()},
        "hooks": [
            (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))
            for m in model.modules()
        ],
        "step_hooks": (len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks)),
        "compiling": torch.compiler.is_compiling(),
    }


def assert_untouched(before: dict, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    after = snapshot(model, opt)
    for (i1, v1, g1), (i2, v2, g2) in zip(before["params"], after["params"]):
        assert i1 == i2 and torch.equal(v1, v2) and g1 is g2
    for b1, b2 in zip(before["buffers"], after["buffers"]):
        assert torch.equal(b1, b2)
    for key in ("modules", "state_obj", "hooks", "step_hooks", "compiling"):
        assert before[key] == after[key], key
    for (l1, ids1, g1), (l2, ids2, g2) in zip(before["groups"], after["groups"]):
        assert l1 == l2 and ids1 == ids2
        assert {k: v for k, v in g1.items() if k != "params"} == {
            k: v for k, v in g2.items() if k != "params"
        }
    assert before["state"].keys() == after["state"].keys()


def make():
    torch.manual_seed(0)
    model = MLP(8, 16, 2, 4)
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def good_step(model, optim, batch):
    model(batch).sum().backward()
    optim.step()
    optim.zero_grad()


def test_no_module(fake_pg):
    model, opt = make()

    @spmd_backend.compile()
    def step(optim, batch):
        optim.step()

    with pytest.raises(SpmdUsageError, match="no torch.nn.Module"):
        step(opt, torch.randn(2, 8))


def test_two_modules(fake_pg):
    model, opt = make()
    other = MLP(8, 16, 2, 4)
    before = snapshot(model, opt)

    @spmd_backend.compile()
    def step(model, other, optim, batch):
        (model(batch) + other(batch)).sum().backward()
        optim.step()

    with pytest.raises(SpmdUsageError, match="2 modules .*MLP, MLP.*exactly one"):
        step(model, other, opt, torch.randn(2, 8))
    assert_untouched(before, model, opt)


def test_two_optimizers(fake_pg):
    model, opt = make()
    opt2 = torch.optim.SGD(model.parameters(), lr=0.1)

    @spmd_backend.compile()
    def step(model, o1, o2, batch):
        model(batch).sum().backward()
        o1.step()
        o2.step()

    with pytest.raises(SpmdUsageError, match="2 optimizers"):
        step(model, opt, opt2, torch.randn(2, 8))


def test_optimizer_with_foreign_parameter(fake_pg):
    model, _ = make()
    stranger = nn.Parameter(torch.randn(3, 5))
    opt = torch.optim.SGD([*model.parameters(), stranger], lr=0.1)
    before = snapshot(model, opt)
    with pytest.raises(SpmdUsageError, match=r"param_groups\[0\]\['params'\]\[4\] \(shape \[3, 5\]\) is not a parameter"):
        spmd_backend.compile()(good_step)(model, opt, torch.randn(2, 8))
    assert_untouched(before, model, opt)


def test_backward_never_called(fake_pg):
    model, opt = make()
    before = snapshot(model, opt)

    @spmd_backend.compile()
    def step(model, optim, batch):
        loss = model(batch).sum()
        optim.step()
        return loss

    with pytest.raises(SpmdUsageError, match="no parameter gradient: loss.backward\\(\\) was never called"):
        step(model, opt, torch.randn(2, 8))
    assert_untouched(before, model, opt)


def test_unsupported_return_value(fake_pg):
    model, opt = make()
    before = snapshot(model, opt)

    class Result:
        pass

    @spmd_backend.compile()
    def step(model, optim, batch):
        model(batch).sum().backward()
        optim.step()
        return {"stats": [Result()]}

    with pytest.raises(SpmdUsageError, match=r"type .*Result at output\['stats'\]\[0\]"):
        step(model, opt, torch.randn(2, 8))
    assert_untouched(before, model, opt)


def test_error_inside_the_step_restores_everything(fake_pg):
    model, opt = make()
    before = snapshot(model, opt)

    @spmd_backend.compile()
    def step(model, optim, batch):
        model(batch).sum().backward()
        optim.step()
        raise ValueError("user bug")

    with pytest.raises(SpmdTraceError, match="user bug"):
        step(model, opt, torch.randn(2, 8))
    assert_untouched(before, model, opt)


def test_captured_real_tensor_is_named(fake_pg):
    model, opt = make()
    captured = torch.randn(4)

    @spmd_backend.compile()
    def step(model, optim, batch):
        (model(batch) * captured).sum().backward()
        optim.step()

    with pytest.raises(SpmdTraceError, match="neither a parameter, buffer"):
        step(model, opt, torch.randn(2, 8))


def test_last_train_step_on_a_plain_graph(fake_pg):
    model, _ = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = spmd_backend.compile()(good_step)
    step(model, opt, torch.randn(2, 8))
    with pytest.raises(SpmdUsageError, match="last_train_step=True.*IterGraphModule"):
        step(model, opt, torch.randn(2, 8), last_train_step=True)


def test_no_process_group():
    model, opt = make()
    with pytest.raises(SpmdDistributedError, match="init_process_group"):
        spmd_backend.compile()(good_step)(model, opt, torch.randn(2, 8))


def test_bad_parallel_mode_arguments():
    with pytest.raises(SpmdUsageError, match="reduce_op='max'"):
        spmd_backend.DataParallel(reduce_op="max")
    with pytest.raises(SpmdUsageError, match="expected a DataParallel"):
        spmd_backend.compile(parallel_mode="ddp")
    with pytest.raises(SpmdUsageError, match="expected Override instances"):
        spmd_backend.compile(module_override=[object()])
