"""Steps that ask ``torch.autograd.grad`` for a gradient inside the step, and sparse gradients.

A gradient penalty (WGAN-GP, R1: the gradient of the output with respect to the input; a
gradient-norm penalty: with respect to the parameters) differentiates through a gradient made
with ``create_graph=True``. DDP reduces only what ``backward()`` accumulates into ``.grad``, so
the penalty uses each rank's own gradient. Through ``backend="spmd"`` both forms failed in the
backend before (the input form: the single-tensor ``inputs`` argument; the parameter form: its
gradients were taken for ``.grad`` and wrapped in a marker without a derivative); both now match
DDP in both doors, with the optimizer zeroed first or last. A sparse gradient (``nn.Embedding(sparse=True)``) is refused naming the
parameter, in both doors (it failed inside torch before).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import spmd_backend
from spmd_backend import SpmdUsageError
from spmd_backend.testing.steps import compiled_by


def input_penalty_step(model, opt, x):
    x = x.clone().requires_grad_(True)
    out = model(x).sum()
    (gx,) = torch.autograd.grad(out, x, create_graph=True)
    loss = out + (gx.norm(2, dim=1) - 1).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def parameter_penalty_step(model, opt, x):
    out = model(x).pow(2).mean()
    grads = torch.autograd.grad(out, list(model.parameters()), create_graph=True)
    loss = out + 0.1 * sum(g.pow(2).sum() for g in grads)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def parameter_penalty_zero_first_step(model, opt, x):
    """Zeroing first: from the second call on every parameter holds a ``.grad`` as it starts."""
    opt.zero_grad(set_to_none=False)
    out = model(x).pow(2).mean()
    grads = torch.autograd.grad(out, list(model.parameters()), create_graph=True)
    loss = out + 0.1 * sum(g.pow(2).sum() for g in grads)
    loss.backward()
    opt.step()
    return loss.detach()


def adaptive_weight_step(model, opt, x):
    """VQGAN's adaptive loss weight: the ratio of two gradients of the last layer's weight."""
    opt.zero_grad()
    out = model(x)
    rec, adv = out.pow(2).mean(), -out.mean()
    last = getattr(model, "module", model)[-1].weight  # DDP wraps the reference
    (g_rec,) = torch.autograd.grad(rec, last, retain_graph=True)
    (g_adv,) = torch.autograd.grad(adv, last, retain_graph=True)
    weight = (g_rec.norm() / (g_adv.norm() + 1e-4)).detach()
    (rec + weight * adv).backward()
    opt.step()
    return weight


STEPS = {
    "input": input_penalty_step,
    "parameters": parameter_penalty_step,
    # until 2026-11-28 the compile door marked a parameter that already held a .grad with a
    # tensor hook, which also ran for torch.autograd.grad: from the second call the adaptive
    # weight was computed from reduced gradients (silently off DDP) and the penalty's
    # double backward failed on the marker
    "parameters_zero_first": parameter_penalty_zero_first_step,
    "adaptive_weight": adaptive_weight_step,
}


def _job(rank: int, world: int, door: str) -> dict[str, float]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    diffs = {}
    for name, step in STEPS.items():
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        ddp = DDP(copy.deepcopy(model))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        ref_opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        compiled = compiled_by(door, step, reduce_op="avg")
        outs = []
        for i in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * i + rank))
            outs.append(float(compiled(model, opt, x)) - float(step(ddp, ref_opt, x)))
        diffs[name] = max(float((p - q).abs().max())
                          for p, q in zip(model.parameters(), ddp.module.parameters()))
        diffs[name + "_returned"] = max(abs(d) for d in outs)
    return diffs


@pytest.mark.multirank
@pytest.mark.parametrize("door", ["compile", "dynamo"])
def test_gradient_penalties_match_ddp(rank_pool, door):
    # batches differ per rank: a penalty computed from reduced gradients would differ from DDP
    for diffs in rank_pool.run(_job, door):
        assert max(diffs.values()) < 1e-6, diffs


@torch._dynamo.disable
def _log(x):
    """A logging call Dynamo does not compile: the step runs in per-graph mode."""


class SparseBag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8, sparse=True)
        self.fc = nn.Linear(8, 1)

    def forward(self, idx):
        return self.fc(self.emb(idx).mean(1))


class LoggedSparseBag(SparseBag):
    def forward(self, idx):
        h = self.emb(idx).mean(1)
        _log(h)
        return self.fc(h)


@pytest.mark.parametrize("door", ["compile", "dynamo", "dynamo_per_graph"])
def test_sparse_gradients_are_refused_naming_the_parameter(fake_pg, door):
    """``dynamo_per_graph``: a graph break in the model; the backward graphs compile at the first
    ``backward()``, where a bucketing pass failed on the sparse gradient ("reshape is not
    implemented for sparse tensors", review 2026-11-28) instead of this refusal."""
    torch._dynamo.reset()
    model = LoggedSparseBag() if door == "dynamo_per_graph" else SparseBag()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]

    def step(model, opt, idx):
        model(idx).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    compiled = (spmd_backend.compile()(step) if door == "compile"
                else torch.compile(step, backend="spmd", options={"inductor": False}))
    with pytest.raises(Exception, match=r"parameter 'emb.weight' gets a torch.sparse_coo "
                                        r"gradient.*sparse=False") as info:
        compiled(model, opt, torch.randint(0, 20, (4, 5)))
    # Dynamo wraps a backend's error in BackendCompilerFailed
    assert isinstance(getattr(info.value, "inner_exception", info.value), SpmdUsageError)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and not opt.state
    # per-graph mode: the head's backward graph ran before the embedding's failed to compile
    written = [model.fc.weight, model.fc.bias] if door == "dynamo_per_graph" else []
    assert all(p.grad is None for p in model.parameters() if all(p is not w for w in written))



def _penalty_on_accumulated_grad_step(model, opt, x):
    opt.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward(create_graph=True)
    penalty = sum(p.grad.pow(2).sum() for p in model.parameters())
    opt.zero_grad()
    penalty.backward()
    opt.step()
    return penalty.detach()


def test_a_penalty_on_an_accumulated_grad_is_refused_by_name(fake_pg):
    """``backward(create_graph=True)`` then a term of ``p.grad`` differentiates the reduced
    gradient; the compile door failed on the marker's missing derivative (review 42). DDP does
    not support it either; the refusal points to ``torch.autograd.grad``."""
    from spmd_backend import SpmdTraceError

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(SpmdTraceError, match=r"differentiates a gradient that backward\(\) "
                                             r"accumulated.*torch\.autograd\.grad"):
        spmd_backend.compile()(_penalty_on_accumulated_grad_step)(model, opt, torch.randn(4, 8))
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(p.grad is None for p in model.parameters()) and not opt.state
