"""Gradient hooks on parameters: ``p.register_hook`` and ``p.register_post_accumulate_grad_hook``.

Under DDP a parameter's hook runs on this rank's gradient before the all-reduce (clipping one
parameter's gradient, masking frozen embedding rows). Both doors used to ignore them silently:
the compile door traced the step on stand-ins of the parameters that did not carry the hooks, the
Dynamo door computes gradients inside its graph. The compile door now runs them where DDP does
(a hook added or removed retraces); the Dynamo door refuses them by name, when it compiles and
before each call (Dynamo does not guard on tensor hooks), leaving the state untouched.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import spmd_backend
from spmd_backend import SpmdUsageError


def clamp(grad):
    return grad.clamp(-0.01, 0.01)  # not linear: clamp(mean) != mean(clamp)


def halve(param):
    param.grad.mul_(0.5)


def train_step(model, opt, x, do_step):
    model(x).pow(2).mean().backward()
    if do_step:
        opt.step()
        opt.zero_grad()


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _job(rank: int, world: int) -> list[float]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _mlp()
    ddp = DDP(copy.deepcopy(model))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    compiled = spmd_backend.compile(parallel_mode=spmd_backend.DataParallel(reduce_op="avg"))(
        train_step)
    handles = [m[0].weight.register_hook(clamp) for m in (model, ddp.module)]
    diffs = []
    for i in range(8):
        if i == 4:  # added later: retraced, run before the reduction as DDP does
            for m in (model, ddp.module):
                m[2].weight.register_post_accumulate_grad_hook(halve)
        if i == 6:  # removed: retraced again
            for h in handles:
                h.remove()
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * i + rank))
        # odd calls accumulate onto the previous call's gradients (the hook runs on the new part)
        compiled(model, opt, x, i % 2 == 1)
        train_step(ddp, ref_opt, x, i % 2 == 1)
        diffs.append(max(float((p - q).abs().max())
                         for p, q in zip(model.parameters(), ddp.module.parameters())))
    return diffs


@pytest.mark.multirank
def test_compile_door_runs_parameter_hooks_as_ddp_does(rank_pool):
    for diffs in rank_pool.run(_job):  # batches differ per rank, so the clamp's place matters
        assert max(diffs) < 1e-6, diffs


@pytest.mark.parametrize("late", [False, True], ids=["before-compile", "after-compile"])
@pytest.mark.parametrize("kind", ["register_hook", "register_post_accumulate_grad_hook"])
def test_dynamo_door_refuses_parameter_hooks_by_name(fake_pg, kind, late):
    torch._dynamo.reset()
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    compiled = torch.compile(train_step, backend="spmd", options={"inductor": False})
    x = torch.randn(4, 8)

    def add_hook():
        getattr(model[0].weight, kind)(clamp if kind == "register_hook" else halve)

    if late:
        compiled(model, opt, x, True)
    add_hook()
    before = [p.detach().clone() for p in model.parameters()]
    momenta = [s["momentum_buffer"].clone() for s in opt.state.values()]
    with pytest.raises(Exception, match=r"parameter '0.weight' has a gradient hook") as info:
        compiled(model, opt, x, True)
    # Dynamo wraps an error raised while compiling in BackendCompilerFailed
    assert isinstance(getattr(info.value, "inner_exception", info.value), SpmdUsageError)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, s["momentum_buffer"]) for a, s in zip(momenta, opt.state.values()))
