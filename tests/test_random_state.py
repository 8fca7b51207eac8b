"""Randomness inside a step that a replayed graph cannot repeat: Python's and numpy's generators,
and torch's seeding functions.

Mixup's ``lam = np.random.beta(a, a)`` or stochastic depth's ``random.random() < p`` were drawn
once while the compile door traced the step and replayed as constants by every later call, with
no warning. The compile door now refuses such a draw naming the line (or, for a function bound
under another name before the trace, naming the generator whose state moved), leaving model,
optimizer and both generators as they were. The Dynamo door draws anew each call and matches
eager, as the error message says. A checkpointed region's recompute replays its forward's
draws (``tracing.random_state.RandomReplay``). Likewise ``torch.manual_seed(k)`` inside the step (the same
dropout masks per step index) ran once while tracing; it is refused naming the line, while torch's
own uses (checkpoint restoring the RNG state for its recompute) still run.
"""

from __future__ import annotations

import copy
import random
from random import uniform as drawn_under_another_name

import numpy as np
import pytest
import torch
import torch.nn as nn

import spmd_backend
from spmd_backend import SpmdUsageError


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def mixup_step(model, opt, x):
    lam = float(np.random.beta(1.0, 1.0))
    loss = model(lam * x + (1 - lam) * x.flip(0)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def stochastic_depth_step(model, opt, x):
    h = model[1](model[0](x))
    if random.random() < 0.5:  # skip the block
        h = h + model[1](h)
    loss = model[2](h).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def aliased_step(model, opt, x):
    loss = (model(x) * drawn_under_another_name(0.5, 1.5)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


RNG = np.random.default_rng(0)


def own_generator_step(model, opt, x):
    lam = float(RNG.beta(1.0, 1.0))
    loss = (model(x) * lam).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


class NoisyLayer(nn.Module):
    """Holds its own Python generator (a layer that perturbs its input by a random scale)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 1)
        self.rng = random.Random(0)

    def forward(self, x):
        return self.fc(x) * self.rng.uniform(0.5, 1.5)


def noisy_step(model, opt, x):
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def test_own_generator_objects_are_refused_and_restored(fake_pg):
    for model, step, generator, match in (
        (_mlp(), own_generator_step, RNG, r"Generator global 'RNG' \(read by own_generator_step\)"),
        (NoisyLayer(), noisy_step, None, r"Random attribute <root>.rng"),
    ):
        generator = generator or model.rng
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        state = copy.deepcopy(generator.bit_generator.state if generator is RNG
                              else generator.getstate())
        with pytest.raises(SpmdUsageError, match=match):
            spmd_backend.compile()(step)(model, opt, torch.randn(4, 8))
        after = generator.bit_generator.state if generator is RNG else generator.getstate()
        assert after == state


@pytest.mark.parametrize("step,match", [
    (mixup_step, r"numpy.random's global generator \(.*np.random.beta"),
    (stochastic_depth_step, r"Python's random module \(.*random.random\(\) < 0.5"),
    (aliased_step, r"Python's random module\. The compile door traces the step once"),
], ids=["numpy-mixup", "random-stochastic-depth", "bound-before-the-trace"])
def test_compile_door_refuses_python_random_draws(fake_pg, step, match):
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = [p.detach().clone() for p in model.parameters()]
    states = random.getstate(), np.random.get_state()
    with pytest.raises(SpmdUsageError, match=match):
        spmd_backend.compile()(step)(model, opt, torch.randn(4, 8))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters()) and not opt.state
    assert random.getstate() == states[0]
    assert all(np.array_equal(a, b) for a, b in zip(np.random.get_state(), states[1]))


def test_dynamo_door_draws_anew_each_call(fake_pg):
    torch._dynamo.reset()
    model = _mlp()
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref = torch.optim.SGD(twin.parameters(), lr=0.1)
    # the fake group of two ranks reduces nothing: "sum" keeps each gradient as eager has it
    compiled = torch.compile(stochastic_depth_step, backend="spmd",
                             options={"inductor": False, "reduce_op": "sum"})
    for i in range(6):
        x = torch.randn(4, 8)
        random.seed(i)
        compiled(model, opt, x)
        random.seed(i)
        stochastic_depth_step(twin, ref, x)
        for p, q in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(p, q)


def seeded_dropout_step(model, opt, x, k):
    torch.manual_seed(k)  # the same masks for the same step index
    loss = nn.functional.dropout(model(x), 0.5).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def test_compile_door_refuses_seeding_inside_the_step(fake_pg):
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    functions = torch.manual_seed, torch.get_rng_state, torch.set_rng_state
    with pytest.raises(SpmdUsageError, match=r"calls torch.manual_seed\(\) \(.*torch.manual_seed\(k\)"):
        spmd_backend.compile()(seeded_dropout_step)(model, opt, torch.randn(4, 8), 3)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert (torch.manual_seed, torch.get_rng_state, torch.set_rng_state) == functions  # restored


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointed_dropout_recomputes_the_forward_mask(fake_pg, reentrant):
    """torch's checkpoint restores the generator state before its recompute, so the recompute
    drops out what the forward dropped. In the compile door the recompute drew a fresh mask
    (0.013 off eager after one step); it now replays the forward's draw, bit for bit eager, and
    leaves the generator where eager leaves it."""
    from torch.utils.checkpoint import checkpoint

    model = _mlp()
    twin = copy.deepcopy(model)
    opt, ref = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, twin))

    def step(model, opt, x):
        h = checkpoint(lambda t: nn.functional.dropout(model[1](t), 0.5), model[0](x),
                       use_reentrant=reentrant)
        loss = model[2](h).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    compiled = spmd_backend.compile()(step)
    for i in range(3):
        x = torch.randn(4, 8)
        torch.manual_seed(i)
        compiled(model, opt, x)
        after = torch.get_rng_state()
        torch.manual_seed(i)
        step(twin, ref, x)
        assert torch.equal(after, torch.get_rng_state())
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


class _Attention(nn.Module):
    """A batch-first attention with dropout, then dropout on its (transposed) output, as
    ``nn.TransformerEncoderLayer`` does."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.attn = nn.MultiheadAttention(8, 2, dropout=0.1, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        out = self.attn(x, x, x, need_weights=False)[0]
        return self.head(nn.functional.dropout(out, 0.1).mean(1))


def _plain_step(model, opt, x):
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def test_dropout_of_a_transposed_tensor_draws_eagers_mask(fake_pg):
    """CPU dropout draws its noise in the memory order of the input's layout; the functional
    form the trace recorded filled a contiguous tensor: another mask than eager's for the same
    seed on every transposed input (0.012 off DDP after three SGD steps of an
    ``nn.Transformer``) until 2026-11-28."""
    model = _Attention()
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(1))
    step = spmd_backend.compile()(_plain_step)
    for seed in range(3):
        torch.manual_seed(seed)
        got = step(model, opt, x)
        after = torch.rand(2)
        torch.manual_seed(seed)
        assert torch.equal(got, _plain_step(twin, twin_opt, x)), seed
        assert torch.equal(after, torch.rand(2))
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
