"""Which parameters an optimizer holds, and which state belongs to which, in a cached graph
of ``backend="spmd"`` (spmd_backend.dynamo.faults, ``_guard_optimizer_identity``, and
spmd_backend.dynamo.graphs, ``guard_parameter_identity``).

The whole-step graph reads a group's parameters and the optimizer state's keys by position.
Until 2026-11-28 it checked only their shapes, so after the user re-pointed the optimizer at
other parameters of the same shapes the cached graph kept stepping the old ones with the old
state: each case below was 0.025 to 0.25 off eager, silently. Each must now match eager (the
fake process group: collectives are no-ops, so the step is eager's).
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from spmd_backend.testing.steps import compiled_by


def _step(model, opt, x, y):
    loss = (model(x) - y).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _batches(n: int, width: int = 4):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 8, generator=gen), torch.randn(6, width, generator=gen)) for _ in range(n)]


def _assert_same(model, ref, opt, ref_opt, atol=1e-7):
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=atol)
    torch.testing.assert_close(opt.state_dict(), ref_opt.state_dict(), rtol=0, atol=atol)


def _twins(build, lr: float = 0.01):
    """A model built from seed 0, its copy, and an Adam over each."""
    torch.manual_seed(0)
    model = build()
    ref = copy.deepcopy(model)
    return model, ref, torch.optim.Adam(model.parameters(), lr=lr), torch.optim.Adam(ref.parameters(), lr=lr)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))


def test_parameters_moved_between_groups_are_stepped_with_their_new_group(fake_pg):
    torch.manual_seed(0)
    model = _mlp()
    ref = copy.deepcopy(model)

    def make(m):
        return torch.optim.SGD([
            {"params": list(m[0].parameters()), "lr": 0.1, "weight_decay": 0.0},
            {"params": list(m[2].parameters()), "lr": 0.001, "weight_decay": 0.5},
            {"params": list(m[4].parameters())},
        ], lr=0.01, momentum=0.9)

    opt, ref_opt = make(model), make(ref)
    compiled = compiled_by("dynamo", _step)
    for i, (x, y) in enumerate(_batches(6)):
        if i == 3:  # same shapes, other settings
            for o in (opt, ref_opt):
                g0, g1 = o.param_groups[0], o.param_groups[1]
                g0["params"], g1["params"] = g1["params"], g0["params"]
        compiled(model, opt, x, y)
        _step(ref, ref_opt, x, y)
    _assert_same(model, ref, opt, ref_opt)


def test_a_replaced_head_is_not_stepped_by_an_optimizer_that_does_not_hold_it(fake_pg):
    model, ref, opt, ref_opt = _twins(_mlp)
    compiled = compiled_by("dynamo", _step)
    for i, (x, y) in enumerate(_batches(5)):
        if i == 2:  # re-initialized, the optimizer not told: eager trains the head no more
            torch.manual_seed(3)
            model[4] = nn.Linear(8, 4)
            torch.manual_seed(3)
            ref[4] = nn.Linear(8, 4)
        compiled(model, opt, x, y)
        _step(ref, ref_opt, x, y)
    _assert_same(model, ref, opt, ref_opt)


def test_one_optimizer_over_two_models_steps_each_with_its_own_group(fake_pg):
    torch.manual_seed(0)
    a, b = _mlp(), _mlp()
    ref_a, ref_b = copy.deepcopy(a), copy.deepcopy(b)
    opt = torch.optim.Adam([{"params": a.parameters()}, {"params": b.parameters(), "lr": 1e-3}], lr=1e-2)
    ref_opt = torch.optim.Adam([{"params": ref_a.parameters()}, {"params": ref_b.parameters(), "lr": 1e-3}],
                               lr=1e-2)
    compiled = compiled_by("dynamo", _step)
    for i, (x, y) in enumerate(_batches(6)):
        compiled(a if i % 2 == 0 else b, opt, x, y)
        _step(ref_a if i % 2 == 0 else ref_b, ref_opt, x, y)
    for m, r in ((a, ref_a), (b, ref_b)):
        for p, q in zip(m.parameters(), r.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-7)
    torch.testing.assert_close(opt.state_dict(), ref_opt.state_dict(), rtol=0, atol=1e-7)


class _Heads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head_a, self.head_b = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, x, which="both"):
        h = torch.tanh(self.body(x))
        if which == "a":
            return self.head_a(h)
        if which == "b":
            return self.head_b(h)
        return self.head_a(h) + 2 * self.head_b(h)


def test_a_checkpoint_that_orders_the_state_differently_keeps_each_parameters_state(fake_pg):
    model, ref, opt, ref_opt = _twins(_Heads)
    batches = _batches(7)

    def step(m, o, x, y, which="both"):
        loss = (m(x, which) - y).pow(2).mean()
        loss.backward()
        o.step()
        o.zero_grad()

    for (x, y), which in zip(batches[:2], "ba"):  # the state's order: body, head_b, head_a
        step(model, opt, x, y, which)
        step(ref, ref_opt, x, y, which)
    compiled = compiled_by("dynamo", step)
    for i, (x, y) in enumerate(batches[2:]):
        if i == 2:  # a checkpoint keyed in parameter order: the state's order is now another
            for o in (opt, ref_opt):
                sd = o.state_dict()
                sd["state"] = dict(sorted(sd["state"].items()))
                o.load_state_dict(sd)
        compiled(model, opt, x, y)
        step(ref, ref_opt, x, y)
    _assert_same(model, ref, opt, ref_opt)


@torch._dynamo.disable
def _log(x: torch.Tensor) -> None:
    """A logging call Dynamo does not compile: a graph break (per-graph mode)."""


class _Broken(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x):
        h = self.a(x)
        _log(h)
        return self.b(h)


def test_cached_graphs_do_not_keep_earlier_models_alive(fake_pg):
    """A k-fold loop through one compiled step: each fold's model and optimizer state are freed
    once the user drops them (until 2026-11-28 the backend's wrappers of each graph held the
    parameters it was compiled for, so every fold's model stayed in memory; stock Dynamo frees
    them)."""
    import gc
    import weakref

    for make in (lambda: nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)), _Broken):
        torch._dynamo.reset()
        compiled = compiled_by("dynamo", _step)
        refs = []
        for _ in range(2):
            model = make()
            opt = torch.optim.Adam(model.parameters(), lr=0.01)
            for x, y in _batches(2):
                compiled(model, opt, x, y)
            first = next(model.parameters())
            refs += [weakref.ref(first), weakref.ref(opt.state[first]["exp_avg"])]
            del model, opt, first
            gc.collect()
            assert [r() for r in refs] == [None] * len(refs), make
