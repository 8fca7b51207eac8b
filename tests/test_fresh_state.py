"""A fresh optimizer's state created before Dynamo traces the step (spmd_backend.dynamo.fresh_state).

What it creates must be what the optimizer's first step would create: training from it equals
training from a fresh optimizer, bit for bit. It must touch nothing else (gradients, SGD's
value-dependent buffer, optimizers with state, classes that are not torch's), and a compile
that fails must take it back. A parameter first updated calls later starts from the state eager
makes then, from its group's settings of that call (Rprop's step size is the lr).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from spmd_backend.dynamo import fresh_state
from spmd_backend.dynamo.fresh_state import create_fresh_state, optimizers_of_frame, remove_state
from spmd_backend.parallel.sharded_state import shard_optimizer_state
from spmd_backend.testing.steps import compiled_by
from spmd_backend.tracing.sharding import ShardSpec


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


OPTIMIZERS = {
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adam_fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
    "adamw_amsgrad": lambda p: torch.optim.AdamW(p, lr=1e-2, amsgrad=True, foreach=False),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-2, momentum=0.5, centered=True),
    "nadam": lambda p: torch.optim.NAdam(p, lr=1e-2),
    "radam": lambda p: torch.optim.RAdam(p, lr=1e-2),
    "adamax": lambda p: torch.optim.Adamax(p, lr=1e-2),
    "adadelta": lambda p: torch.optim.Adadelta(p),
    "asgd": lambda p: torch.optim.ASGD(p, lr=1e-2),
    "rprop": lambda p: torch.optim.Rprop(p, lr=1e-2),
}


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 3) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        model(torch.randn(5, 6, generator=gen)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_training_from_created_state_equals_training_from_a_fresh_optimizer(name):
    fresh, created_first = _model(), _model()
    opt_a, opt_b = OPTIMIZERS[name](fresh.parameters()), OPTIMIZERS[name](created_first.parameters())
    created = create_fresh_state([opt_b], settings_dependent=True)
    assert len(created) == 4 and len(opt_b.state) == 4
    assert all(p.grad is None for p in created_first.parameters())  # stand-ins removed
    _train(fresh, opt_a)
    _train(created_first, opt_b)
    for p, q in zip(fresh.parameters(), created_first.parameters()):
        assert torch.equal(p, q)
    torch.testing.assert_close(opt_a.state_dict(), opt_b.state_dict(), rtol=0, atol=0)


def test_existing_gradients_are_kept():
    model = _model()
    model(torch.ones(2, 6)).sum().backward()
    grads = [p.grad for p in model.parameters()]
    snapshot = [g.clone() for g in grads]
    create_fresh_state([torch.optim.Adam(model.parameters())])
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))
    assert all(torch.equal(g, s) for g, s in zip(grads, snapshot))


class MyAdam(torch.optim.Adam):
    pass


def test_what_is_left_alone():
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # buffer = first gradient
    mine = MyAdam(model.parameters())  # not a torch.optim class: its step may differ
    frozen = nn.Linear(2, 2).requires_grad_(False)
    frozen_adam = torch.optim.Adam(frozen.parameters())
    assert create_fresh_state([sgd, mine, frozen_adam]) == []
    assert not sgd.state and not mine.state and not frozen_adam.state


def test_groups_with_state_are_left_alone_and_remove_state_undoes_exactly():
    model = _model()
    params = list(model.parameters())
    opt = torch.optim.Adam([{"params": params[:2]}, {"params": params[2:]}])
    opt.state[params[0]]["step"] = torch.tensor(5.0)  # group 0 already has state
    created = create_fresh_state([opt])
    assert {id(p) for _, p in created} == {id(p) for p in params[2:]}
    assert dict(opt.state[params[0]]).keys() == {"step"}
    remove_state(created)
    assert set(opt.state) == {params[0]}


def test_optimizers_of_frame_finds_arguments_closures_and_globals():
    model = _model()
    arg, cell_opt, global_opt = (torch.optim.Adam(model.parameters()) for _ in range(3))
    globals()["_GLOBAL_OPT"] = global_opt

    def step(opt):
        return cell_opt, _GLOBAL_OPT  # noqa: F821 - a global the code names

    found = optimizers_of_frame(step.__code__, {"opt": arg, "n": 3}, globals(), step.__closure__)
    assert {id(o) for o in found} == {id(arg), id(cell_opt), id(global_opt)}
    del globals()["_GLOBAL_OPT"]


def test_a_compile_that_fails_takes_the_created_state_back():
    import spmd_backend.backend  # noqa: F401 - installs the frame hook

    model = _model()
    before = copy.deepcopy(model.state_dict())
    opt = torch.optim.Adam(model.parameters())

    def step(model, opt, x):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="spmd", options={"bucket_size_mb": -1})
    with pytest.raises(Exception, match="SpmdUsageError: bucket_size_mb must be a positive"):
        compiled(model, opt, torch.ones(2, 6))
    assert not opt.state
    assert all(p.grad is None for p in model.parameters())
    torch.testing.assert_close(model.state_dict(), before, rtol=0, atol=0)


@pytest.fixture(autouse=True)
def _own_tracking(monkeypatch):
    """Entries tracked by other tests (their objects not collected yet) stay out of these."""
    monkeypatch.setattr(fresh_state, "_TRACKED", [])


class _TwoHeads(nn.Module):
    """A second head trained from the third call on (a curriculum, a multi-task schedule)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head_a, self.head_b = nn.Linear(6, 8), nn.Linear(8, 3), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        return self.head_b(h) if use_b else self.head_a(h)


def _two_heads_step(model, opt, x, use_b):
    model(x, use_b).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _late_head_run(step, name: str, calls: int = 6, between=lambda: None):
    model = _TwoHeads()
    opt = OPTIMIZERS[name](model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    gen = torch.Generator().manual_seed(1)
    for i in range(calls):
        between()
        step(model, opt, torch.randn(5, 6, generator=gen), i >= 3)
        sched.step()
    return model, opt


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_parameter_first_updated_later_starts_from_that_calls_settings(name):
    eager_model, eager_opt = _late_head_run(_two_heads_step, name)
    created, tracked = [], None

    def created_first(model, opt, x, use_b):  # what sharding's hook and the backend do per call
        nonlocal tracked
        if not created:
            created.extend(create_fresh_state([opt], settings_dependent=True))
            fresh_state.keep_fresh(created, None)
            tracked = len(fresh_state._TRACKED)
        fresh_state.refresh()
        _two_heads_step(model, opt, x, use_b)

    model, opt = _late_head_run(created_first, name)
    assert len(created) == 6  # head_b's state too, made before its first update
    # tracked only where the settings change the fresh state (not the Adam family's zeros)
    assert tracked == (6 if name in ("asgd", "rprop") else 0)
    assert not fresh_state._TRACKED  # every tracked entry was updated
    for p, q in zip(eager_model.parameters(), model.parameters()):
        assert torch.equal(p, q)
    torch.testing.assert_close(opt.state_dict(), eager_opt.state_dict(), rtol=0, atol=0)


def test_a_state_made_from_the_settings_is_left_to_the_step_unless_sharded():
    """Rprop's and ASGD's fresh state is their lr: made inside the graph, from each call's."""
    for make in (lambda p: torch.optim.Rprop(p, lr=0.1), lambda p: torch.optim.ASGD(p, lr=0.1)):
        opt = make(_TwoHeads().parameters())
        assert create_fresh_state([opt]) == [] and not opt.state
        assert len(create_fresh_state([opt], settings_dependent=True)) == 6


def test_a_sharded_entry_is_remade_as_this_ranks_shard():
    model = _TwoHeads()
    opt = torch.optim.Rprop(model.parameters(), lr=0.1)
    spec = ShardSpec(rank=1, world=2)
    created = create_fresh_state([opt], settings_dependent=True)
    shard_optimizer_state(opt, spec)
    fresh_state.keep_fresh(created, spec)
    weight = model.head_b.weight
    step_size = opt.state[weight]["step_size"]
    opt.param_groups[0]["lr"] = 0.025
    fresh_state.refresh()
    assert opt.state[weight]["step_size"] is step_size  # in place: the graphs read this tensor
    torch.testing.assert_close(step_size, spec.shard_of(torch.full_like(weight, 0.025)))


def test_tracking_ends_with_the_entry():
    model = _TwoHeads()
    opt = torch.optim.Rprop(model.parameters(), lr=0.1)
    fresh_state.keep_fresh(create_fresh_state([opt], settings_dependent=True), None)
    saved = copy.deepcopy(opt.state_dict())
    opt.load_state_dict(saved)  # new entries: the loaded state is the user's
    opt.param_groups[0]["lr"] = 0.5
    fresh_state.refresh()
    assert not fresh_state._TRACKED
    assert float(opt.state[model.head_b.bias]["step_size"][0]) == pytest.approx(0.1)


def _lr_written_in_step(model, opt, x, use_b):
    for g in opt.param_groups:  # a warmup written in the step: halves the lr each call
        g["lr"] = g["lr"] * 0.5
    _two_heads_step(model, opt, x, use_b)


@pytest.mark.parametrize("step", [_two_heads_step, _lr_written_in_step])
@pytest.mark.parametrize("name", ["rprop", "asgd"])
def test_the_dynamo_door_starts_a_late_parameter_as_eager_does(fake_pg, name, step):
    eager_model, eager_opt = _late_head_run(step, name)
    torch._dynamo.reset()
    model, opt = _late_head_run(compiled_by("dynamo", step), name)
    for p, q in zip(eager_model.parameters(), model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-7)
    torch.testing.assert_close(opt.state_dict(), eager_opt.state_dict(), rtol=0, atol=1e-7)
