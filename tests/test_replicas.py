"""Steps whose parameter update depends on a rank's own batch without a collective are refused
by the compile door (spmd_backend/parallel/replicas.py): the replicas would drift apart, as they
do under DDP, which averages only what backward() accumulates. One process under a fake process
group; the analysis reads the traced graph, so one rank shows what every rank would do.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import spmd_backend
from spmd_backend import DataParallel, SpmdUsageError
from spmd_backend.parallel.replicas import rank_local_writes


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def surgery_step(model, opt, x, y):
    """Two task losses, their gradients combined by hand (PCGrad-like gradient surgery)."""
    params = list(model.parameters())
    out = model(x)
    task = torch.autograd.grad(F.cross_entropy(out, y), params, retain_graph=True)
    aux = torch.autograd.grad(out.pow(2).mean(), params)
    for p, a, b in zip(params, task, aux):
        p.grad = a + 0.1 * b
    opt.step()
    opt.zero_grad()


def local_term_step(model, opt, x, y):
    """backward() for every parameter, then one gradient replaced by a local one."""
    out = model(x)
    (local,) = torch.autograd.grad(out.pow(2).mean(), [model[2].bias], retain_graph=True)
    F.cross_entropy(out, y).backward()
    model[2].bias.grad = local
    opt.step()
    opt.zero_grad()


def loss_scaled_update_step(model, opt, x, y, lr_scale):
    """A setting passed as a one-element tensor scales the gradients: the same on every rank."""
    F.cross_entropy(model(x), y).backward()
    for p in model.parameters():
        p.grad.mul_(lr_scale)
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("fn, optim, match", [
    (surgery_step, "sgd", r"updates parameters without loss\.backward\(\).*torch\.autograd\.grad"),
    (local_term_step, "sgd", r"parameter '2\.bias' is updated from argument args\[2\] without"),
    (local_term_step, "adam", r"parameter .2\.bias. \(and 2 more\) is updated from argument "
                            r"args\[2\] without"),
])
def test_updates_from_a_ranks_own_batch_are_refused(fake_pg, fn, optim, match):
    """The fused multi-tensor kernels are followed element by element: only the parameter whose
    gradient is local is named."""
    model = _model()
    opt = (torch.optim.SGD(model.parameters(), lr=0.1) if optim == "sgd"
           else torch.optim.Adam(model.parameters(), lr=0.1))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(SpmdUsageError, match=match + r".*drift apart.*Nothing was changed"):
        spmd_backend.compile()(fn)(model, opt, torch.randn(6, 8), torch.randint(0, 4, (6,)))
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b) and p.grad is None
    assert not opt.state


def test_a_one_element_setting_and_the_escape_hatch(fake_pg):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
    spmd_backend.compile()(loss_scaled_update_step)(model, opt, x, y, torch.tensor(0.5))
    spmd_backend.compile(parallel_mode=DataParallel(check_consistency=False))(local_term_step)(
        model, opt, x, y)


def test_collectives_and_markers_stop_the_batch_but_element_lists_do_not_mix():
    """On a hand-built graph: a value reduced by a collective is replicated; a list op taints
    only the elements whose inputs are rank-local."""
    g = fx.Graph()
    p0, p1, batch = (g.placeholder(n) for n in ("p0", "p1", "batch"))
    local = g.call_function(torch.ops.aten.mul.Tensor, (batch, 2.0))
    reduced = g.call_function(torch.ops._c10d_functional.all_reduce.default, (local, "sum", "0"))
    waited = g.call_function(torch.ops._c10d_functional.wait_tensor.default, (reduced,))
    g.call_function(torch.ops.aten._foreach_add_.List, ([p0, p1], [waited, local]))
    g.output(None)
    writes = rank_local_writes(g, {2: "argument batch"}, {0: "p0", 1: "p1"}, {})
    assert [(w.target, w.source) for w in writes] == [("p1", "argument batch")]


def reduced_surgery_step(model, opt, x, y):
    """The fix the refusal suggests in the Dynamo door: reduce the computed gradients."""
    params = list(model.parameters())
    out = model(x)
    task = torch.autograd.grad(F.cross_entropy(out, y), params, retain_graph=True)
    aux = torch.autograd.grad(out.pow(2).mean(), params)
    for p, a, b in zip(params, task, aux):
        g = a + 0.1 * b
        torch.distributed.all_reduce(g)
        p.grad = g
    opt.step()
    opt.zero_grad()


def test_the_dynamo_door_refuses_the_same_and_takes_its_own_collective(fake_pg):
    """Through backend="spmd" the check runs on the whole-step graph before the markers become
    collectives; the step's own all_reduce of the gradients it computes (captured in the graph)
    makes them replicated, and the step compiles."""
    torch._dynamo.reset()
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
    options = {"inductor": False, "reduce_op": "sum"}
    with pytest.raises(Exception, match=r"parameter '2\.bias' \(and 2 more\) is updated from "
                                        r"input .*drift apart") as info:
        torch.compile(local_term_step, backend="spmd", options=options)(model, opt, x, y)
    assert isinstance(getattr(info.value, "inner_exception", info.value), SpmdUsageError)
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b) and p.grad is None
    assert not opt.state
    torch._dynamo.reset()
    torch.compile(reduced_surgery_step, backend="spmd", options=options)(model, opt, x, y)
    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


class MaxNormTagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(30, 16, max_norm=1.0)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.emb(x).mean(1))


def test_embedding_max_norm_is_named(fake_pg):
    """``nn.Embedding(max_norm=...)`` renormalizes, in forward and in place, the rows this
    rank's batch looks up: under DDP the ranks' embedding weights differ after the first step.
    The refusal says so and how to renormalize alike on every rank."""
    torch.manual_seed(0)
    model = MaxNormTagger()
    with torch.no_grad():
        model.emb.weight.mul_(3)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    x, y = torch.randint(0, 30, (6, 5)), torch.randint(0, 4, (6,))

    def tagger_step(model, opt, x, y):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    with pytest.raises(SpmdUsageError, match=r"parameter 'emb\.weight'.*nn\.Embedding\(max_norm="
                                             r"\.\.\.\) does this"):
        spmd_backend.compile()(tagger_step)(model, opt, x, y)
