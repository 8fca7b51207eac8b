"""Steps written other than ``step(model, optim, batch)``.

A GAN step: two modules, two optimizers, two backward passes in one step. The discriminator steps on real and detached fake samples; the generator's loss then runs the
discriminator again, whose parameters receive gradients from both backward passes (the second
set is cleared by the next step's ``zero_grad``). DDP users wrap each module in its own DDP.
The Dynamo door takes any number of modules and optimizers and matches that; the compile door
takes one module and one optimizer and says which door to use instead.

A trainer's method (``trainer.step(batch)`` reading ``self.model`` and ``self.opt``): the
Dynamo door reads them through ``self`` and matches DDP, a hyper-parameter on ``self`` changed
between calls included; the compile door names the attributes and both ways out.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_backend
from spmd_backend import SpmdUsageError


def gan_step(gen, disc, opt_g, opt_d, real, z):
    fake = gen(z)
    logits = disc(torch.cat([real, fake.detach()]))
    target = torch.cat([torch.ones(real.shape[0], 1), torch.zeros(z.shape[0], 1)])
    d_loss = F.binary_cross_entropy_with_logits(logits, target)
    opt_d.zero_grad()
    d_loss.backward()
    opt_d.step()
    g_loss = F.binary_cross_entropy_with_logits(disc(fake), torch.ones(z.shape[0], 1))
    opt_g.zero_grad()
    g_loss.backward()
    opt_g.step()
    return d_loss.detach(), g_loss.detach()


def _models():
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    disc = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    return gen, disc


def _adam(module):
    return torch.optim.Adam(module.parameters(), lr=1e-2, betas=(0.5, 0.999))


def _job(rank: int, world: int, inductor: bool) -> dict[str, float]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch._dynamo.reset()
    gen, disc = _models()
    ref_gen, ref_disc = DDP(copy.deepcopy(gen)), DDP(copy.deepcopy(disc))
    opt_g, opt_d, ref_opt_g, ref_opt_d = _adam(gen), _adam(disc), _adam(ref_gen), _adam(ref_disc)
    compiled = torch.compile(gan_step, backend="spmd",
                             options={"inductor": inductor, "reduce_op": "avg"})
    losses = 0.0
    for i in range(3):
        g = torch.Generator().manual_seed(10 * i + rank)
        real, z = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        got = compiled(gen, disc, opt_g, opt_d, real, z)
        want = gan_step(ref_gen, ref_disc, ref_opt_g, ref_opt_d, real, z)
        losses = max(losses, *(abs(float(a) - float(b)) for a, b in zip(got, want)))
    return {
        "generator": max(float((p - q).abs().max())
                         for p, q in zip(gen.parameters(), ref_gen.module.parameters())),
        "discriminator": max(float((p - q).abs().max())
                             for p, q in zip(disc.parameters(), ref_disc.module.parameters())),
        "losses": losses,
    }


@pytest.mark.multirank
def test_a_gan_step_through_the_dynamo_door_matches_ddp(rank_pool):
    # each rank its own batches: without the reduction the discriminators would drift apart
    for diffs in rank_pool.run(_job, False):
        assert max(diffs.values()) < 1e-6, diffs


def test_the_compile_door_points_a_gan_to_the_dynamo_door(fake_pg):
    gen, disc = _models()
    opt_g, opt_d = _adam(gen), _adam(disc)
    before = [p.detach().clone() for p in [*gen.parameters(), *disc.parameters()]]
    compiled = spmd_backend.compile()(gan_step)
    with pytest.raises(SpmdUsageError, match=r"2 modules.*backend=\"spmd\"\), which takes any"):
        compiled(gen, disc, opt_g, opt_d, torch.randn(6, 8), torch.randn(6, 4))

    class Gan(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gen, self.disc = gen, disc

    def wrapped(gan, opts, real, z):
        return gan_step(gan.gen, gan.disc, *opts, real, z)

    with pytest.raises(SpmdUsageError, match=r"2 optimizers.*backend=\"spmd\"\), which takes any"):
        spmd_backend.compile()(wrapped)(Gan(), (opt_g, opt_d), torch.randn(6, 8), torch.randn(6, 4))
    after = [*gen.parameters(), *disc.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert all(p.grad is None for p in after) and not opt_g.state and not opt_d.state


class Trainer:
    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        self.clip = 1.0

    def step(self, x):
        loss = self.model(x).pow(2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.opt.zero_grad()
        return loss.detach()


def _trainer_job(rank: int, world: int) -> float:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    trainer, ref = Trainer(model), Trainer(DDP(copy.deepcopy(model)))
    compiled = torch.compile(trainer.step, backend="spmd",
                             options={"inductor": False, "reduce_op": "avg"})
    for i in range(4):
        if i == 2:  # a tight clip from here on: a graph that baked 1.0 would differ
            trainer.clip = ref.clip = 0.01
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * i + rank))
        compiled(x)
        ref.step(x)
    return max(float((p - q).abs().max())
               for p, q in zip(model.parameters(), ref.model.module.parameters()))


@pytest.mark.multirank
def test_a_trainer_method_through_the_dynamo_door_matches_ddp(rank_pool):
    assert max(rank_pool.run(_trainer_job)) < 1e-6


def test_the_compile_door_names_what_a_trainer_method_reads_through_self(fake_pg):
    torch.manual_seed(0)
    trainer = Trainer(nn.Linear(8, 1))
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.raises(SpmdUsageError, match=r"method that reads Trainer\.model, Trainer\.opt "
                                             r"through self.*train_step\(self\.model, self\.opt"):
        spmd_backend.compile()(trainer.step)(torch.randn(4, 8))
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    assert all(p.grad is None for p in trainer.model.parameters()) and not trainer.opt.state
