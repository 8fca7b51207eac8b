"""spmd_backend.compile on one process under a fake process group: graph shape and behaviour."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F

import spmd_backend
from spmd_backend.graph import ops
from spmd_backend.graph.meta import Phase, get_phase
from spmd_backend.testing.models import GPT, MLP, BatchNormNet
from spmd_backend.testing.steps import train_step as sgd_step

c10d = torch.ops._c10d_functional


def eager_twin(model, optim_cls, **kw):
    twin = copy.deepcopy(model)
    return twin, optim_cls(twin.parameters(), **kw)


def nodes(gm, pred):
    return [n for n in gm.graph.nodes if pred(n)]


def test_one_all_reduce_per_gradient_placed_in_backward(fake_pg):
    torch.manual_seed(0)
    model = MLP(8, 16, 3, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = spmd_backend.compile()(sgd_step)
    step(model, opt, torch.randn(4, 8))
    gm = step.graph.traced.gm
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    reduces = nodes(gm, ops.is_all_reduce)
    assert len(reduces) == len(list(model.parameters()))
    for ar in reduces:
        assert ar.args[1] == "sum"
        (wait,) = ar.users
        assert ops.is_wait(wait)
        # issued right where the gradient is produced, not at the end of the backward
        assert order[ar] - order[ar.args[0]] <= 2
    mms = nodes(gm, lambda n: n.target is torch.ops.aten.mm.default)
    assert order[reduces[0]] < order[mms[-1]], "first gradient collective waits for all compute"
    assert not nodes(gm, ops.is_grad_marker)


@pytest.mark.parametrize("world", [2, 3])
def test_mean_is_taken_after_the_sum_only_where_that_is_bit_identical(world):
    # a power-of-two world: the sum's wait, then * 1/world just before the optimizer reads the
    # gradient (the collective then runs on the gradient as the backward made it); any other
    # world: DDP's own order, * 1/world before the sum
    from spmd_backend.testing import fake_process_group

    torch.manual_seed(0)
    model = MLP(8, 16, 2, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with fake_process_group(world_size=world):
        step = spmd_backend.compile(
            parallel_mode=spmd_backend.DataParallel(reduce_op="avg"))(sgd_step)
        step(model, opt, torch.randn(4, 8))
    gm = step.graph.traced.gm
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    mul = torch.ops.aten.mul.Tensor
    reduces = nodes(gm, ops.is_all_reduce)
    assert len(reduces) == len(list(model.parameters()))
    for ar in reduces:
        (wait,) = ar.users
        if world == 2:
            assert ar.args[0].target is not mul, ar.args[0].format_node()
            (scaled,) = wait.users
            assert scaled.target is mul and scaled.args == (wait, 0.5)
            # placed at the first reader, so the wait is free to move that late
            assert all(order[scaled] < order[u] for u in scaled.users)
            assert order[scaled] > max(order[m] for m in nodes(gm, lambda n: n.target is torch.ops.aten.mm.default))
        else:
            assert ar.args[0].target is mul and ar.args[0].args[1] == 1.0 / 3
            assert all(u.target is not mul for u in wait.users)


class _Odd(torch.nn.Module):
    """A 15-element weight (shards of 8: the last one padded) and a 3-element bias."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(5, 3)

    def forward(self, x):
        return self.fc(x)


@pytest.mark.parametrize("reduce_scatter_grads", [None, False])
def test_sharded_gradients_reduce_scattered_or_all_reduced_and_sliced(reduce_scatter_grads):
    # the fake group runs reduce_scatter natively: the default keeps it; asked not to (gloo's
    # default), each gradient is all-reduced whole and this rank's slice copied, only the slice
    # (the short last shard padded, never the whole gradient)
    from spmd_backend.testing import fake_process_group

    torch.manual_seed(0)
    model = _Odd()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    mode = spmd_backend.DataParallel(reduce_op="avg", shard_optimizer=True,
                                     reduce_scatter_grads=reduce_scatter_grads)
    with fake_process_group(world_size=2):  # rank 0
        step = spmd_backend.compile(parallel_mode=mode)(sgd_step)
        step(model, opt, torch.randn(4, 5))
    gm = step.graph.traced.gm
    scatters = nodes(gm, lambda n: ops.is_call_to(n, c10d.reduce_scatter_tensor.default))
    reduces = nodes(gm, ops.is_all_reduce)
    if reduce_scatter_grads is None:
        assert len(scatters) == 2 and not reduces
        return
    assert not scatters and len(reduces) == 2
    slices = nodes(gm, lambda n: n.target is torch.ops.aten.slice.Tensor and _reads_a_wait(n))
    # weight: rank 0's 8 of 15; bias: rank 0's 2 of 3; copied, not padded
    assert sorted(tuple(n.meta["val"].shape) for n in slices) == [(2,), (8,)]
    assert all([u.target for u in n.users] == [torch.ops.aten.clone.default] for n in slices)
    with fake_process_group(world_size=2, rank=1):  # the last rank's shards run past the end
        step1 = spmd_backend.compile(parallel_mode=mode)(sgd_step)
        twin = copy.deepcopy(model)
        step1(twin, torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9), torch.randn(4, 5))
    gm1 = step1.graph.traced.gm
    pads = [u for n in nodes(gm1, lambda n: n.target is torch.ops.aten.slice.Tensor and _reads_a_wait(n))
            for u in n.users]
    assert all(p.target is torch.ops.aten.constant_pad_nd.default for p in pads), pads
    # weight: elements 8..14 (7) padded to 8; bias: element 2 (1) padded to 2
    assert sorted((p.args[0].meta["val"].numel(), p.meta["val"].numel()) for p in pads) == [(1, 2), (7, 8)]


def _reads_a_wait(node) -> bool:
    """``node`` reads an all_reduce's wait through views and the mean's scaling."""
    for _ in range(4):
        node = node.args[0]
        if ops.is_wait(node):
            return ops.is_all_reduce(node.args[0])
        if node.target not in (torch.ops.aten.view.default, torch.ops.aten.reshape.default,
                               torch.ops.aten.mul.Tensor):
            return False
    return False


def test_reduce_scatter_is_native_except_on_gloo():
    from spmd_backend.parallel.data_parallel import reduce_scatter_is_native

    class _Group:
        def __init__(self, backend):
            self.backend = backend

        def _get_backend(self, device):
            return self.backend

    gloo = torch.distributed.ProcessGroupGloo(torch.distributed.HashStore(), 0, 1)
    assert not reduce_scatter_is_native(_Group(gloo), torch.device("cpu"))
    assert reduce_scatter_is_native(_Group(object()), torch.device("cpu"))


def test_graph_is_functional_with_state_written_back_by_copy(fake_pg):
    torch.manual_seed(0)
    model = MLP(8, 16, 2, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = spmd_backend.compile()(sgd_step)
    for _ in range(2):
        step(model, opt, torch.randn(4, 8))
    gm = step.graph.traced.gm
    placeholders = nodes(gm, ops.is_placeholder)
    copies = nodes(gm, ops.is_copy_)
    # every parameter and momentum buffer is written once, at the end, into its placeholder
    written = {c.args[0] for c in copies}
    assert written <= set(placeholders)
    n_params = len(list(model.parameters()))
    assert len(written) == 2 * n_params
    names = [p.name for p in placeholders]
    assert names[0] == "p_layers_0_weight"
    assert any(n.startswith("s_layers_0_weight_momentum_buffer") for n in names)
    assert any(n.startswith("h_lr_g0") for n in names)
    # no in-place op other than the write-back copies
    for n in gm.graph.nodes:
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
            if n.target._schema.is_mutable:
                assert ops.is_copy_(n) or ops.is_collective(n), n.format_node()


def test_every_node_has_a_phase(fake_pg):
    torch.manual_seed(0)
    model = MLP(8, 16, 2, 4)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    step = spmd_backend.compile()(sgd_step)
    for _ in range(2):
        step(model, opt, torch.randn(4, 8))
    gm = step.graph.traced.gm
    phases = {n: get_phase(n) for n in gm.graph.nodes}
    assert all(p is not None for p in phases.values())
    assert {Phase.INPUT, Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER, Phase.COMM} <= set(
        phases.values()
    )
    for n in gm.graph.nodes:
        if ops.is_all_reduce(n) or ops.is_wait(n):
            assert phases[n] is Phase.COMM
        if n.target is torch.ops.aten._fused_adam.tensor_lr:
            assert phases[n] is Phase.OPTIMIZER


@pytest.mark.parametrize(
    "optim_cls,kw",
    [
        (torch.optim.SGD, dict(lr=0.05)),
        (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, foreach=False)),
        (torch.optim.Adam, dict(lr=0.01, fused=True)),
        (torch.optim.AdamW, dict(lr=0.01, foreach=True, weight_decay=0.1)),
    ],
)
def test_matches_eager_on_one_rank_with_lr_schedule(fake_pg, optim_cls, kw):
    """One rank, fake collectives: the compiled step is the eager step, lr schedule included."""
    torch.manual_seed(0)
    model = MLP(8, 16, 3, 4)
    ref, ref_opt = eager_twin(model, optim_cls, **kw)
    opt = optim_cls(model.parameters(), **kw)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    step = spmd_backend.compile()(sgd_step)
    for _ in range(5):
        batch = torch.randn(4, 8)
        loss = step(model, opt, batch)
        ref_loss = sgd_step(ref, ref_opt, batch)
        torch.testing.assert_close(loss, ref_loss)
        sched.step()
        ref_sched.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)
    assert step.trace_count <= 2, "an lr change must not retrace"


def test_lr_is_read_at_every_call(fake_pg):
    torch.manual_seed(0)
    model = MLP(8, 16, 2, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = spmd_backend.compile()(sgd_step)
    step(model, opt, torch.randn(4, 8))
    before = [p.detach().clone() for p in model.parameters()]
    opt.param_groups[0]["lr"] = 0.0
    step(model, opt, torch.randn(4, 8))
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b), "lr=0 must leave parameters unchanged"
    assert step.trace_count == 1


def test_optimizer_state_created_as_eager_and_transformation_called_once(fake_pg):
    torch.manual_seed(0)
    model = MLP(8, 16, 2, 4)
    ref, ref_opt = eager_twin(model, torch.optim.SGD, lr=0.1, momentum=0.9, dampening=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=0.5)
    calls = []

    def transformation(gm):
        calls.append(gm)
        return gm

    step = spmd_backend.compile(gm_transformation=transformation)(sgd_step)
    for i in range(4):
        batch = torch.randn(4, 8)
        step(model, opt, batch)
        sgd_step(ref, ref_opt, batch)
        if i == 0:
            assert step.graph.bootstrap and not calls
    assert len(calls) == 1 and step.trace_count == 2
    assert step.compiled is calls[0]
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)
        torch.testing.assert_close(
            opt.state[p]["momentum_buffer"], ref_opt.state[q]["momentum_buffer"]
        )


def test_retrace_on_new_shape_is_logged_once_and_cached(fake_pg, caplog):
    torch.manual_seed(0)
    model = MLP(8, 16, 2, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = spmd_backend.compile()(sgd_step)
    step(model, opt, torch.randn(4, 8))
    with caplog.at_level(logging.WARNING, logger="spmd_backend"):
        step(model, opt, torch.randn(3, 8))
        step(model, opt, torch.randn(3, 8))
        step(model, opt, torch.randn(4, 8))
    retraces = [r for r in caplog.records if "retracing" in r.getMessage()]
    assert len(retraces) == 1
    assert "args[2]" in retraces[0].getMessage() and "[3, 8]" in retraces[0].getMessage()
    assert step.trace_count == 2 and step.cache_size() == 2
    step(model, opt, torch.randn(4, 8, dtype=torch.float64).float())
    assert step.trace_count == 2


def test_batchnorm_buffers_updated_in_place(fake_pg):
    torch.manual_seed(0)
    model = BatchNormNet()
    ref, ref_opt = eager_twin(model, torch.optim.SGD, lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mean = model.bn.running_mean
    step = spmd_backend.compile()(sgd_step)
    for _ in range(3):
        batch = torch.randn(8, 16)
        step(model, opt, batch)
        sgd_step(ref, ref_opt, batch)
    assert model.bn.running_mean is mean
    torch.testing.assert_close(model.bn.running_mean, ref.bn.running_mean)
    torch.testing.assert_close(model.bn.num_batches_tracked, ref.bn.num_batches_tracked)
    gm = step.graph.traced.gm
    # one coalesced broadcast per buffer dtype, as DDP's (running statistics; the counter)
    assert len(nodes(gm, ops.is_broadcast)) == len({b.dtype for b in model.buffers()}) == 2


def test_buffer_broadcasts_are_cut_into_buckets(fake_pg, monkeypatch):
    """A bucket holds at most BUCKET_BYTES of buffer (DDP's 250 MB for its buffers): the two
    running statistics (128 bytes each) in two broadcasts under a 200-byte cap, and the counter;
    the step still trains like eager."""
    from spmd_backend.parallel import buffer_broadcast

    monkeypatch.setattr(buffer_broadcast, "BUCKET_BYTES", 200)
    torch.manual_seed(0)
    model = BatchNormNet()
    ref, ref_opt = eager_twin(model, torch.optim.SGD, lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = spmd_backend.compile()(sgd_step)
    for _ in range(2):
        batch = torch.randn(8, 16)
        step(model, opt, batch)
        sgd_step(ref, ref_opt, batch)
    torch.testing.assert_close(model.bn.running_var, ref.bn.running_var)
    assert len(nodes(step.graph.traced.gm, ops.is_broadcast)) == 3


def test_tied_weights_lifted_once_and_gpt_matches_eager(fake_pg):
    torch.manual_seed(0)
    model = GPT(vocab=32, dim=16, heads=2, layers=1, seq=8)
    ref, ref_opt = eager_twin(model, torch.optim.AdamW, lr=0.01, fused=True)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)

    def lm_step(model, optim, batch):
        out = model(batch)
        loss = F.cross_entropy(out.reshape(-1, 32), batch.reshape(-1))
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    step = spmd_backend.compile()(lm_step)
    for _ in range(3):
        batch = torch.randint(0, 32, (2, 8))
        step(model, opt, batch)
        lm_step(ref, ref_opt, batch)
    assert model.head.weight is model.tok.weight
    gm = step.graph.traced.gm
    weight_inputs = [n for n in gm.graph.nodes if n.op == "placeholder" and "tok_weight" in n.name]
    assert len(weight_inputs) == 1 + 3  # the weight, its Adam step and two moments
    assert not [n for n in gm.graph.nodes if n.op == "placeholder" and "head" in n.name]
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)


def test_unused_and_frozen_parameters_get_no_collective(fake_pg):
    from spmd_backend.testing.models import FrozenNet, UnusedParamNet

    for cls, trainable_used in ((UnusedParamNet, 4), (FrozenNet, 2)):
        model = cls()
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        step = spmd_backend.compile()(sgd_step)
        step(model, opt, torch.randn(8, 16))
        assert step.graph.expansion.all_reduces == trainable_used
        for name, p in model.named_parameters():
            assert p.grad is None, name


def test_grad_left_by_the_step_is_written_back(fake_pg):
    torch.manual_seed(0)
    model = MLP(8, 16, 2, 4)
    ref = copy.deepcopy(model)

    def backward_only(model, batch):
        model(batch).sum().backward()

    step = spmd_backend.compile()(backward_only)
    for _ in range(2):  # the second call accumulates into the existing .grad
        batch = torch.randn(4, 8)
        step(model, batch)
        backward_only(ref, batch)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_return_structure_preserved(fake_pg):
    torch.manual_seed(0)
    model = MLP(8, 16, 2, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step_fn(model, optim, batch, *, scale=1.0):
        out = model(batch)
        loss = out.pow(2).mean() * scale
        loss.backward()
        optim.step()
        optim.zero_grad()
        return {"loss": loss, "extra": (out.detach().sum(), None, 3, "tag")}

    step = spmd_backend.compile()(step_fn)
    res = step(model, opt, torch.randn(4, 8), scale=2.0)
    assert set(res) == {"loss", "extra"}
    assert isinstance(res["loss"], torch.Tensor) and res["loss"].dim() == 0
    assert res["extra"][1:] == (None, 3, "tag")
