"""The compile door's handling of the Python state a step writes (tracing/side_effects.py).

The trace runs the step's Python once. Before, a module attribute set in forward kept a trace
tensor, an argument dict's new key never reached the caller, and an append to a global list
happened once, all silently. Now assignments to module attributes and argument dict keys are
replayed after every call, as eager leaves them, and other writes are refused with the state as
it was. One process under a fake process group, against the same step run eagerly.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_backend
from spmd_backend import SpmdUsageError
from spmd_backend.tracing.side_effects import is_trace_tensor


def snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> tuple:
    return ([(p.detach().clone(), p.grad) for p in model.parameters()],
            {id(k): {n: (v.clone() if isinstance(v, torch.Tensor) else v) for n, v in s.items()}
             for k, s in opt.state.items()})


def assert_untouched(before: tuple, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    params, state = before
    for (value, grad), p in zip(params, model.parameters()):
        assert torch.equal(value, p) and grad is p.grad
    assert state.keys() == {id(k) for k in opt.state}
    for k, s in opt.state.items():
        for n, v in s.items():
            assert torch.equal(v, state[id(k)][n]) if isinstance(v, torch.Tensor) else v == state[id(k)][n]


class Remembering(nn.Module):
    """Keeps what its last forward computed, as attention-map and statistics hooks do."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self.last_mean: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(x)
        self.last_mean = out.detach().mean(0)
        return out


def metrics_step(model, opt, batch, metrics):
    labels = batch.pop("labels")
    loss = F.cross_entropy(model(batch["x"]), labels)
    loss.backward()
    opt.step()
    opt.zero_grad()
    metrics["loss"] = loss.detach()
    metrics["calls"] = metrics.get("calls", 0) + 1
    metrics.pop("stale", None)
    return loss.detach()


def _batch(i: int) -> dict:
    g = torch.Generator().manual_seed(i)
    return {"x": torch.randn(6, 8, generator=g), "labels": torch.randint(0, 4, (6,), generator=g)}


def test_module_attributes_and_argument_dicts_are_written_as_eager_writes_them(fake_pg):
    torch.manual_seed(0)
    model = Remembering()
    twin = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    twin_opt = torch.optim.Adam(twin.parameters(), lr=0.05)
    step = spmd_backend.compile()(metrics_step)
    for i in range(4):
        got_batch, want_batch = _batch(i), _batch(i)
        got_metrics, want_metrics = {"stale": 1.0}, {"stale": 1.0}
        got = step(model, opt, got_batch, got_metrics)
        want = metrics_step(twin, twin_opt, want_batch, want_metrics)
        torch.testing.assert_close(got, want)
        # the caller's dicts: the popped key gone, the new keys there, with this call's values
        assert set(got_batch) == {"x"}
        assert set(got_metrics) == {"loss", "calls"} and got_metrics["calls"] == 1
        assert not is_trace_tensor(got_metrics["loss"])
        torch.testing.assert_close(got_metrics["loss"], want_metrics["loss"])
        assert not is_trace_tensor(model.last_mean)
        torch.testing.assert_close(model.last_mean, twin.last_mean)
    assert step.trace_count == 2  # the first call creates Adam's state; no retrace after
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)


LOSSES: list = []
CACHE: dict = {}


def appending_step(model, opt, x):
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    LOSSES.append(loss.detach())
    return loss.detach()


def caching_step(model, opt, x):
    if x.shape[0] not in CACHE:  # a mask cached across calls, made inside the step
        CACHE[x.shape[0]] = torch.ones(x.shape[0], 1) * x.mean()
    loss = (model(x) * CACHE[x.shape[0]]).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def norm_keeping_step(model, opt, x):
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.last_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    return loss.detach()


class Trainer:
    def __init__(self) -> None:
        self.last_loss: torch.Tensor | None = None
        self.history: list[float] = [0.5]

    def step(self, model, opt, x):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        self.last_loss = loss.detach()
        return loss.detach()


@pytest.mark.parametrize("case", ["global list", "global dict", "object attribute",
                                  "optimizer attribute"])
def test_writes_outside_the_step_are_refused_with_the_state_as_it_was(fake_pg, case):
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()  # state to keep
    trainer = Trainer()
    fn, match = {
        "global list": (appending_step, r"appends to global 'LOSSES' \(read by appending_step\), "
                                        r"a list"),
        "global dict": (caching_step, r"sets key 4 of global 'CACHE' \(read by caching_step\), "
                                      r"a dict"),
        "object attribute": (trainer.step, r"sets .*\.last_loss to a tensor it computed"),
        "optimizer attribute": (norm_keeping_step, r"sets the optimizer Adam\.last_norm to a "
                                                   r"tensor it computed"),
    }[case]
    LOSSES[:] = ["earlier"]
    CACHE.clear()
    before = snapshot(model, opt)
    with pytest.raises(SpmdUsageError, match=match + r".*Nothing was changed"):
        spmd_backend.compile()(fn)(model, opt, torch.randn(4, 8))
    assert_untouched(before, model, opt)
    assert LOSSES == ["earlier"] and CACHE == {}
    assert trainer.last_loss is None and trainer.history == [0.5]
    assert not hasattr(opt, "last_norm")


def failing_step(model, opt, x):
    LOSSES.append("partial")
    loss = model(x).pow(2).mean()
    loss.backward()
    raise RuntimeError("user error after the append")


def test_a_step_that_fails_while_traced_leaves_the_python_state_as_it_was(fake_pg):
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    LOSSES[:] = []
    with pytest.raises(Exception, match="user error after the append"):
        spmd_backend.compile()(failing_step)(model, opt, torch.randn(4, 8))
    assert LOSSES == []


def list_argument_step(model, opt, x, log):
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    log.append(loss.detach())
    return loss.detach()


def test_an_argument_list_the_step_appends_to_is_refused(fake_pg):
    """The trace sees a copy of the caller's list: the append never reached the caller."""
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    log: list = []
    with pytest.raises(SpmdUsageError, match=r"changes argument args\[3\], a list"):
        spmd_backend.compile()(list_argument_step)(model, opt, torch.randn(4, 8), log)
    assert log == []


def plain_step(model, opt, x):
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def test_torch_hooks_that_set_module_weight_are_replayed(fake_pg):
    """torch's old-style weight_norm recomputes ``module.weight`` (a plain attribute) in a
    forward pre-hook: after each compiled call it holds that call's weight, as in eager."""
    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(torch.nn.utils.weight_norm(nn.Linear(8, 16)), nn.Tanh(),
                             nn.Linear(16, 2))

    model, twin = build(), build()  # a weight-normed module cannot be deep-copied
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    twin_opt = torch.optim.Adam(twin.parameters(), lr=0.05)
    step = spmd_backend.compile()(plain_step)
    for i in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
        torch.testing.assert_close(step(model, opt, x), plain_step(twin, twin_opt, x))
        assert not is_trace_tensor(model[0].weight)
        torch.testing.assert_close(model[0].weight.detach(), twin[0].weight.detach())


def test_torch_module_caches_get_their_value_back(fake_pg):
    """An LSTM's ``_flat_weights`` list holds the trace's stand-ins after its traced forward;
    torch refreshes it itself, so it is put back (not refused) and an eager forward after the
    compiled step works."""
    torch.manual_seed(0)

    class Tagger(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = nn.LSTM(8, 16, batch_first=True)
            self.head = nn.Linear(16, 2)

        def forward(self, x):
            return self.head(self.lstm(x)[0])

    model = Tagger()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    spmd_backend.compile()(plain_step)(model, opt, torch.randn(3, 5, 8))
    assert not any(is_trace_tensor(w) for w in model.lstm._flat_weights)
    model(torch.randn(3, 5, 8)).sum().backward()


class Rebinding(nn.Module):
    """Keeps running values by rebinding its buffers (``self.avg = ...``), not in place."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 4)
        self.register_buffer("avg", torch.zeros(8))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))
        self.register_buffer("last", torch.zeros(0))  # sized by the first forward

    def forward(self, x):
        self.avg = 0.9 * self.avg + 0.1 * x.detach().mean(0)
        self.seen = self.seen + x.shape[0]
        self.last = x.detach()[-1] * 2
        return self.body(x - self.avg)


def test_buffers_the_step_rebinds_are_written_back_as_eager_leaves_them(fake_pg):
    """Before 2026-11-28 the rebinding vanished with the trace: every run started from the
    buffer's first value, which stayed (0.89 off DDP after four steps of an EMA)."""
    torch.manual_seed(0)
    model = Rebinding()
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    avg = model.avg
    step = spmd_backend.compile()(plain_step)
    for i in range(4):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) + i
        torch.testing.assert_close(step(model, opt, x), plain_step(twin, twin_opt, x))
        for name, want in twin.named_buffers():
            torch.testing.assert_close(dict(model.named_buffers())[name], want, msg=name)
        torch.testing.assert_close(model.body.weight, twin.body.weight)
    assert model.avg is avg  # written into the buffer the module holds
    assert not any(is_trace_tensor(b) for b in model.buffers())


class Retyping(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 4)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.seen = self.seen / 2  # a float now: a write-back would round it
        return self.body(x)


def test_a_buffer_rebound_to_another_dtype_is_refused_with_nothing_changed(fake_pg):
    model = Retyping()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = snapshot(model, opt)
    seen = model.seen
    with pytest.raises(SpmdUsageError, match=r"buffer 'seen' is rebound by the step to a "
                                             r"torch.float32 value \(it was torch.int64\)"
                                             r".*Nothing was changed"):
        spmd_backend.compile()(plain_step)(model, opt, torch.randn(4, 8))
    assert_untouched(before, model, opt)
    assert model.seen is seen and model.seen.item() == 0


class Registering(nn.Module):
    """Registers a running mean in its first forward (sized by the data) and updates it after."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 4)

    def forward(self, x):
        if not hasattr(self, "center"):
            self.register_buffer("center", x.detach().mean(0), persistent=False)
        else:
            self.center.mul_(0.9).add_(x.detach().mean(0), alpha=0.1)
        return self.body(x - self.center)


def test_a_buffer_the_step_registers_is_registered_as_eager_does(fake_pg):
    """Before 2026-11-28 the new buffer kept the trace's stand-in (unusable after the call)."""
    torch.manual_seed(0)
    model = Registering()
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    step = spmd_backend.compile()(plain_step)
    for i in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) + i
        torch.testing.assert_close(step(model, opt, x), plain_step(twin, twin_opt, x))
        assert not is_trace_tensor(model.center)
        torch.testing.assert_close(model.center, twin.center)
    assert "center" in model._non_persistent_buffers_set and "center" not in model.state_dict()


@pytest.mark.parametrize("door", ["compile", "dynamo"])
def test_a_lazy_module_not_yet_run_is_refused_naming_its_parameters(fake_pg, door):
    """The Dynamo door failed inside Dynamo ('UserDefinedObjectVariable' object has no attribute
    'proxy') until 2026-11-28 (hunt 41)."""
    def compiled():
        torch._dynamo.reset()
        return (spmd_backend.compile()(plain_step) if door == "compile" else
                torch.compile(plain_step, backend="spmd", options={"inductor": False}))

    model = nn.Sequential(nn.LazyLinear(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(Exception, match=r"0\.weight, 0\.bias are not initialized yet "
                                        r"\(a lazy module.*Run one forward") as info:
        compiled()(model, opt, torch.randn(4, 8))
    assert isinstance(getattr(info.value, "inner_exception", info.value), SpmdUsageError)
    assert nn.parameter.is_lazy(model[0].weight)
    model(torch.randn(2, 8))  # torch's remedy, then a compiled step works
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled()(model, opt, torch.randn(4, 8))


class _Sharing(nn.Module):
    """One buffer registered in two modules; the first rebinds it (eager unties them)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 4)
        self.a.register_buffer("avg", torch.zeros(8))
        self.b = nn.Module()
        self.b.register_buffer("avg", self.a.avg)

    def forward(self, x):
        self.a.avg = 0.9 * self.a.avg + 0.1 * x.detach().mean(0)
        return self.a(x - self.b.avg)


def test_a_buffer_under_two_names_rebound_under_one_is_refused(fake_pg):
    """Found in review (2026-11-28): the write-back reached both names, eager unties them."""
    model = _Sharing()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = snapshot(model, opt)
    with pytest.raises(SpmdUsageError, match=r"buffer 'a\.avg' is registered under 2 names and "
                                             r"is rebound by the step.*Nothing was changed"):
        spmd_backend.compile()(plain_step)(model, opt, torch.randn(4, 8))
    assert_untouched(before, model, opt)
    assert model.a.avg is model.b.avg and not model.a.avg.any()
