"""tracing/buffer_views.py: a buffer registered as a view of another buffer is traced as a view.

Before 2026-11-28 the compile door lifted both as unrelated inputs: a count updated through its
base lost the update in the half its view covers (DDP's buffer broadcast wrote the view's stale
copy back over it), silently. The unit tests compare with eager in one process (fake group), the
multi-rank test with DDP, whose buffer broadcast reaches both names (both doors: Dynamo's
AOTAutograd traces aliased inputs itself).
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn

import spmd_backend
from spmd_backend.errors import SpmdUsageError
from spmd_backend.tracing.buffer_views import find_buffer_views


class _Windowed(nn.Module):
    """A running count and a window of its first half; positional codes and a slice of them."""

    def __init__(self, update: str) -> None:
        super().__init__()
        self.update = update
        self.lin = nn.Linear(8, 8)
        codes = torch.randn(16, 8)
        self.register_buffer("codes", codes, persistent=False)
        self.register_buffer("head", codes[:8], persistent=False)
        self.register_buffer("count", torch.zeros(4))
        self.register_buffer("window", self.count[:2])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.update == "base":
            self.count.add_(x.mean())
        elif self.update == "view":
            self.window.add_(x.mean())
        return self.lin(x + self.head).pow(2).mean() + self.window.sum()


def step(model, opt, x):
    loss = model(x)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _twins(model):
    twin = copy.deepcopy(model)  # keeps the sharing
    return (model, torch.optim.SGD(model.parameters(), lr=0.1),
            twin, torch.optim.SGD(twin.parameters(), lr=0.1))


@pytest.mark.parametrize("update", ["base", "view"])
def test_an_update_through_either_name_reaches_both_as_in_eager(fake_pg, update):
    torch.manual_seed(0)
    model, opt, twin, twin_opt = _twins(_Windowed(update))
    compiled = spmd_backend.compile()(step)
    for _ in range(3):
        x = torch.randn(8, 8)
        torch.testing.assert_close(compiled(model, opt, x), step(twin, twin_opt, x))
    torch.testing.assert_close(model.count, twin.count, rtol=0, atol=0)
    assert model.window.data_ptr() == model.count.data_ptr(), "the sharing was broken"
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)


def _own_memory(m: nn.Module) -> None:
    m.window.data = m.window.data.clone()


def _second_half(m: nn.Module) -> None:
    m.window.data = m.count.data[2:]


@pytest.mark.parametrize("update,change", [("base", _own_memory), ("view", _second_half)],
                         ids=["own_memory", "moved"])
def test_changing_the_sharing_with_data_retraces(fake_pg, caplog, update, change):
    """``.data =`` gives the window memory of its own, or moves it to the second half of the
    count (same shape, same base), without replacing the buffer object: the graph that traced
    the old layout must not be reused (the move was, before review: the offset was not keyed)."""
    torch.manual_seed(0)
    model, opt, twin, twin_opt = _twins(_Windowed(update))
    compiled = spmd_backend.compile()(step)
    x = torch.randn(8, 8)
    compiled(model, opt, x)
    step(twin, twin_opt, x)
    for m in (model, twin):
        change(m)
    with caplog.at_level(logging.WARNING, logger="spmd_backend"):
        for _ in range(2):
            x = torch.randn(8, 8)
            torch.testing.assert_close(compiled(model, opt, x), step(twin, twin_opt, x))
    assert any("which buffers share memory changed" in r.getMessage() for r in caplog.records)
    torch.testing.assert_close(model.count, twin.count, rtol=0, atol=0)
    torch.testing.assert_close(model.window, twin.window, rtol=0, atol=0)


class _Reshaped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("count", torch.zeros(4))
        self.register_buffer("window", self.count[:2])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.window.unsqueeze_(0)  # changes the view's shape in place
        return self.lin(x).pow(2).mean()


def test_reshaping_a_view_in_place_is_refused(fake_pg):
    model = _Reshaped()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(spmd_backend.SpmdError, match="changed the shape or strides of buffer window"):
        spmd_backend.compile()(step)(model, opt, torch.randn(8, 8))
    assert model.window.shape == (2,)


def _step_with_counts(model, opt, x, counts):
    loss = model(x)
    counts.mul_(2)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def test_an_argument_sharing_a_buffers_memory_is_refused(fake_pg):
    """``step(model, opt, x, model.count)``: two graph inputs for one tensor, each written back
    on its own (found in review: the count ended as neither name's update left it)."""
    torch.manual_seed(0)
    model = _Windowed("base")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.count.clone()
    with pytest.raises(SpmdUsageError, match=r"argument args\[3\] shares memory with the module's "
                                             r"buffer 'count'"):
        spmd_backend.compile()(_step_with_counts)(model, opt, torch.randn(8, 8), model.count)
    torch.testing.assert_close(model.count, before, rtol=0, atol=0)


class _Leaf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("scale", torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


class _Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.leaf = _Leaf()
        self.body = nn.Sequential(self.leaf, nn.Tanh(), self.leaf)  # one block, three names

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).pow(2).mean()


def test_a_module_registered_twice_keeps_its_tensors(fake_pg):
    """``Sequential(block, act, block)``: the trace swapped the block's tensors once per name,
    saved its own stand-in as the original under the second, and left FunctionalTensors in the
    module after the first call (the second call failed; found in review)."""
    torch.manual_seed(0)
    model, opt, twin, twin_opt = _twins(_Twice())
    compiled = spmd_backend.compile()(step)
    for _ in range(3):
        x = torch.randn(4, 8)
        torch.testing.assert_close(compiled(model, opt, x), step(twin, twin_opt, x))
    assert type(model.leaf.lin.weight) is nn.Parameter and type(model.leaf.scale) is torch.Tensor
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)


def _strided(model: nn.Module) -> None:
    model.register_buffer("column", model.codes[:, :2])


def _overlapping(model: nn.Module) -> None:
    memory = torch.zeros(20)  # not a buffer itself
    model.register_buffer("middle", memory[:12])
    model.register_buffer("late", memory[6:])


def _parameter(model: nn.Module) -> None:
    model.register_buffer("weight_row", model.lin.weight.detach()[0])


@pytest.mark.parametrize("change,match", [
    (_strided, "'column' is a strided view of buffer 'codes'"),
    (_overlapping, "buffers 'middle' and 'late' share part of their memory"),
    (_parameter, "buffer 'weight_row' shares memory with parameter 'lin.weight'"),
])
def test_sharing_it_cannot_trace_is_refused_with_nothing_changed(fake_pg, change, match):
    torch.manual_seed(0)
    model = _Windowed("base")
    change(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {k: v.clone() for k, v in model.state_dict(keep_vars=False).items()}
    with pytest.raises(SpmdUsageError, match=match):
        spmd_backend.compile()(step)(model, opt, torch.randn(8, 8))
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    assert all(p.grad is None for p in model.parameters()) and not opt.state


class _TableRow(nn.Module):
    """A row of a table registered as a buffer of its own; the forward writes another row."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 12), nn.Linear(12, 2)
        self.register_buffer("table", torch.zeros(4, 12))
        self.register_buffer("row", self.table[1])

    def forward(self, x):
        h = torch.relu(self.a(x)) + self.row
        self.table[0].add_(h.mean(0).detach())
        return self.b(h).pow(2).mean()


def test_a_buffer_write_beside_a_view_is_not_taken_for_a_parameters(fake_pg):
    """AOTAutograd merges the table and its row into one input, and the graph's inputs no
    longer lined up with Dynamo's: until 2026-11-28 the write of the batch into the table was
    refused as a parameter updated without a collective (the Dynamo door's drift check)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, opt, twin, twin_opt = _twins(_TableRow())
    compiled = torch.compile(step, backend="spmd", options={"inductor": False, "reduce_op": "sum"})
    for _ in range(3):
        x = torch.randn(4, 6)
        torch.testing.assert_close(compiled(model, opt, x), step(twin, twin_opt, x))
    torch.testing.assert_close(model.state_dict(), twin.state_dict())


def test_the_outermost_buffer_is_the_base():
    table = torch.zeros(4, 6)
    buffers = [table[1], table, table[1:3], torch.zeros(2), table.view(24)]
    names = [("row",), ("table",), ("rows",), ("own",), ("flat",)]
    assert find_buffer_views(buffers, names, [], []) == ((1, 6), None, (1, 6), None, (1, 0))


def _ddp_job(rank: int, world: int, update: str, door: str) -> tuple[float, float]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from spmd_backend.parallel.data_parallel import DataParallel

    torch.manual_seed(0)
    model = _Windowed(update)
    ddp = DDP(copy.deepcopy(model))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    if door == "compile":
        compiled = spmd_backend.compile(parallel_mode=DataParallel(reduce_op="avg"))(step)
    else:
        torch._dynamo.reset()
        compiled = torch.compile(step, backend="spmd", options={"inductor": False})
    gen = torch.Generator().manual_seed(rank)  # each rank's count moves by its own batches
    for _ in range(3):
        x = torch.randn(8, 8, generator=gen)
        compiled(model, opt, x)
        step(ddp, ref_opt, x)
    params = max(float((p - q).abs().max()) for p, q in zip(model.parameters(), ddp.parameters()))
    buffers = max(float((b - c).abs().max()) for b, c in zip(model.buffers(), ddp.module.buffers()))
    return params, buffers


@pytest.mark.multirank
@pytest.mark.parametrize("door", ["compile", "dynamo"])
@pytest.mark.parametrize("update", ["base", "view"])
def test_buffer_views_match_ddp(rank_pool, update, door):
    for params, buffers in rank_pool.run(_ddp_job, update, door):
        assert params < 1e-6 and buffers < 1e-6, (update, params, buffers)
