"""A step that fails leaves the model, optimizer and gradients exactly as they were.

One process, fake process group. A transformation injects an op that raises after some
in-place optimizer updates already ran; the call must raise an SpmdRuntimeError naming that
node, every parameter, buffer, gradient and optimizer-state tensor must equal its value before
the call, and training must continue exactly like eager afterwards. Also: in-place rewrites
never change a tensor's shape or dtype (RAdam's 0-dim step).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import spmd_backend
from spmd_backend import SpmdRuntimeError
from spmd_backend.gm_transformation import GraphModuleTransformation
from spmd_backend.graph.commit import inputs_at_risk
from spmd_backend.graph.meta import Phase, get_phase, inherit
from spmd_backend.testing.steps import train_step as step

FAULT = {"on": False}


@torch.library.custom_op("spmd_test::fault_", mutates_args=("x",))
def fault_(x: torch.Tensor) -> None:
    if FAULT["on"]:
        raise RuntimeError("injected fault")


@fault_.register_fake
def _fault_fake(x: torch.Tensor) -> None:
    return None


def _writes(node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(
        a.alias_info is not None and a.alias_info.is_write for a in schema.arguments
    )


def insert_fault_after_first_update(gm):
    """After the first in-place optimizer op, call the fault op."""
    for node in gm.graph.nodes:
        if get_phase(node) is Phase.OPTIMIZER and node.op == "call_function" and _writes(node):
            first = node.args[0][0] if isinstance(node.args[0], (list, tuple)) else node.args[0]
            with gm.graph.inserting_after(node):
                injected = gm.graph.call_function(torch.ops.spmd_test.fault_.default, (first,))
            inherit(injected, node)
            injected.meta["val"] = None
            return
    raise AssertionError("no in-place optimizer op found")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16, bias=False)  # a bias before BatchNorm gets no gradient
        self.bn = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def snapshot(model, opt):
    tensors = [t.detach().clone() for t in model.parameters()]
    tensors += [b.clone() for b in model.buffers()]
    tensors += [t.clone() for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    return tensors, grads


def assert_same(a, b):
    (ta, ga), (tb, gb) = a, b
    assert len(ta) == len(tb)
    for x, y in zip(ta, tb):
        assert torch.equal(x, y)
    for x, y in zip(ga, gb):
        assert (x is None and y is None) or torch.equal(x, y)


@pytest.mark.parametrize("inductor", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_fault_after_in_place_updates_restores_everything(fake_pg, inductor):
    torch.manual_seed(0)
    model = Net()
    twin = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, foreach=True)
    twin_opt = torch.optim.Adam(twin.parameters(), lr=0.01, foreach=True)
    transformation = GraphModuleTransformation(
        enable_graph_optimization=True, enable_inductor=inductor,
        extra_passes=[insert_fault_after_first_update],
    )
    compiled = spmd_backend.compile(gm_transformation=transformation)(step)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(8, 8, generator=gen)
        compiled(model, opt, x)
        step(twin, twin_opt, x)
    assert compiled.graph.rollback.positions, "the injected op follows in-place updates"
    before = snapshot(model, opt)
    FAULT["on"] = True
    try:
        with pytest.raises(SpmdRuntimeError, match="injected fault") as info:
            compiled(model, opt, torch.randn(8, 8, generator=gen))
    finally:
        FAULT["on"] = False
    assert "fault_" in str(info.value) and "restored" in str(info.value)
    assert_same(snapshot(model, opt), before)
    for _ in range(2):  # training goes on as if the failed call never happened
        x = torch.randn(8, 8, generator=gen)
        compiled(model, opt, x)
        step(twin, twin_opt, x)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_default_pipeline_snapshots_only_step_counters(fake_pg, impl):
    """Parameters and moments are written only after every collective; only the step counters
    (incremented before the gradients arrive) need a snapshot, which costs a few scalars."""
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=0.01, **{impl: True})
    transformation = GraphModuleTransformation(enable_graph_optimization=True)
    compiled = spmd_backend.compile(gm_transformation=transformation)(step)
    for _ in range(2):
        compiled(model, opt, torch.randn(8, 8))
    risk = inputs_at_risk(compiled.compiled.graph)
    assert risk.names and all(n.endswith("_step") for n in risk.names), risk
    assert compiled.graph.rollback.names == risk.names


def test_failure_before_any_write_changes_nothing(fake_pg):
    """An index out of range in the forward: nothing written, nothing to restore."""

    class Embed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.bn = nn.BatchNorm1d(4)

        def forward(self, ids):
            return self.bn(self.emb(ids))

    model = Embed()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    compiled = spmd_backend.compile()(step)
    for _ in range(2):
        compiled(model, opt, torch.randint(0, 10, (6,)))
    before = snapshot(model, opt)
    with pytest.raises(SpmdRuntimeError, match="the compiled step failed at node") as info:
        compiled(model, opt, torch.tensor([1, 2, 30, 4, 5, 6]))  # 30 is out of range
    assert "embedding" in str(info.value)
    assert_same(snapshot(model, opt), before)


@pytest.mark.parametrize("impl", ["foreach", "single"])
def test_radam_in_place_rewrite_keeps_shapes(fake_pg, impl):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    twin = copy.deepcopy(model)
    opt = torch.optim.RAdam(model.parameters(), lr=0.01, foreach=impl == "foreach")
    twin_opt = torch.optim.RAdam(twin.parameters(), lr=0.01, foreach=impl == "foreach")
    compiled = spmd_backend.compile(
        gm_transformation=GraphModuleTransformation(enable_graph_optimization=True)
    )(step)
    for _ in range(8):  # RAdam's rectified branch starts after 5 steps
        x = torch.randn(4, 16)
        compiled(model, opt, x)
        step(twin, twin_opt, x)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)


def insert_fault_before_last_wait(gm):
    """Right before the graph's last wait, a fault op (on the batch, which nothing writes): the
    last bucket's collective "fails" after the earlier buckets' have completed."""
    from spmd_backend.graph import ops

    last = [n for n in gm.graph.nodes if ops.is_wait(n)][-1]
    batch = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    with gm.graph.inserting_before(last):
        injected = gm.graph.call_function(torch.ops.spmd_test.fault_.default, (batch,))
    inherit(injected, last)
    injected.meta["val"] = None


class Deep(nn.Module):
    """Four 512x512 layers (1 MiB weights): with 1 MB buckets, one bucket per layer."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Sequential(nn.Linear(512, 512), nn.ReLU()) for _ in range(4)))

    def forward(self, x):
        return self.layers(x)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["fused", "single"])
def test_inductor_keeps_updates_after_a_later_collective(fake_pg, impl):
    """Inductor must not run an earlier bucket's optimizer update before a later bucket's
    collective has completed: its peak-memory reordering did (the update frees the bucket), so
    a failing later collective left the earlier layers' parameters and moments updated without
    a snapshot to restore them. Fails with ``reorder_for_peak_memory`` on."""
    torch.manual_seed(0)
    model = Deep()
    twin = copy.deepcopy(model)
    kwargs = {"fused": True} if impl == "fused" else {"foreach": False}
    opt = torch.optim.Adam(model.parameters(), lr=0.01, **kwargs)
    twin_opt = torch.optim.Adam(twin.parameters(), lr=0.01, **kwargs)
    transformation = GraphModuleTransformation(
        enable_graph_optimization=True, enable_inductor=True, bucket_size_mb=1,
        extra_passes=[insert_fault_before_last_wait], background_compile=False,
    )
    compiled = spmd_backend.compile(gm_transformation=transformation)(step)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(16, 512, generator=gen)
        compiled(model, opt, x)
        step(twin, twin_opt, x)
    waits = [n for n in compiled.compiled.graph.nodes if "wait_tensor" in str(n.target)]
    assert len(waits) >= 3, "several buckets"
    before = snapshot(model, opt)
    FAULT["on"] = True
    try:
        with pytest.raises(SpmdRuntimeError, match="injected fault"):
            compiled(model, opt, torch.randn(16, 512, generator=gen))
    finally:
        FAULT["on"] = False
    assert_same(snapshot(model, opt), before)
    for _ in range(2):
        x = torch.randn(16, 512, generator=gen)
        compiled(model, opt, x)
        step(twin, twin_opt, x)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)


def test_rollback_plan_keeps_small_snapshots_and_restores_the_latest():
    from spmd_backend.runtime import KEEP_BUFFERS_BYTES, RollbackPlan

    small = [torch.tensor(1.0), torch.zeros(3, dtype=torch.int64), torch.tensor(5.0)]
    plan = RollbackPlan((0, 2), ("a", "c"), "test")
    first = plan.snapshot(small)
    small[0].add_(1)
    small[2].add_(1)
    second = plan.snapshot(small)
    assert second[0] is first[0], "small snapshots reuse the plan's buffers"
    small[0].fill_(-7)
    small[2].fill_(-7)
    plan.restore(small, second)
    assert small[0].item() == 2.0 and small[2].item() == 6.0  # the latest snapshot, not the first
    small[0] = torch.tensor([1.0, 2.0])  # another shape at the same position: new buffers
    third = plan.snapshot(small)
    assert third[0].shape == (2,) and torch.equal(third[0], small[0])

    big = [torch.ones(KEEP_BUFFERS_BYTES // 4 + 1)]
    plan = RollbackPlan((0,), ("big",), "test")
    one, two = plan.snapshot(big), plan.snapshot(big)
    assert one[0] is not two[0] and not plan._buffers, "large snapshots are not held between calls"
    big[0].zero_()
    plan.restore(big, two)
    assert bool((big[0] == 1).all())


@pytest.mark.parametrize("door", ["compile", "dynamo"])
def test_fused_state_left_in_another_dtype_is_refused_before_anything_runs(fake_pg, door):
    """``model.double()`` after a fused AdamW created float32 state: torch's kernel raises only
    after incrementing the step counts (eager's ``optimizer.step()`` leaves them so), and the
    Dynamo door said nothing was written while they were. Both doors now refuse while compiling,
    naming the state and its parameter, with nothing changed; the advice given then works."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    compiled = (spmd_backend.compile()(step) if door == "compile" else
                torch.compile(step, backend="spmd", options={"inductor": False, "reduce_op": "sum"}))
    for _ in range(2):
        compiled(model, opt, torch.randn(8, 8))
    model.double()
    before = copy.deepcopy((model.state_dict(), opt.state_dict()))
    x = torch.randn(8, 8, dtype=torch.float64)
    with pytest.raises(Exception, match=r"exp_avgs\[0\] \(\w+\) is float32 on cpu but its "
                                        r"parameter \(\w+\) is float64 on cpu") as info:
        compiled(model, opt, x)
    # Dynamo wraps an error raised while compiling in BackendCompilerFailed
    assert isinstance(getattr(info.value, "inner_exception", info.value),
                      spmd_backend.SpmdUsageError), repr(info.value)
    after = (model.state_dict(), opt.state_dict())
    torch.testing.assert_close(after[0], before[0], rtol=0, atol=0)
    torch.testing.assert_close(after[1]["state"], before[1]["state"], rtol=0, atol=0)
    assert all(p.grad is None for p in model.parameters())

    opt.load_state_dict(opt.state_dict())  # the advice: the state follows the parameters
    twin = copy.deepcopy(model)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=0.01, fused=True)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # (a live state_dict shares tensors)
    compiled(model, opt, x)
    step(twin, twin_opt, x)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)
