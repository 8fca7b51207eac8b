"""Custom ``torch.autograd.Function``s inside the model, as people write them: a gradient reversal
layer with a Python strength kept on ``ctx``, a straight-through estimator, an activation with
``save_for_backward`` and ``once_differentiable``, the ``setup_context`` form reading
``ctx.needs_input_grad``, and an in-place function with ``mark_dirty``. Both doors against the
same step run eagerly (one process, fake process group); the gradients go through the
functions' own backward, so a door that traced torch's derivative of the forward instead (or
dropped ``ctx`` state) would differ.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

import spmd_backend


class GradReverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, strength):
        ctx.strength = strength
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.neg() * ctx.strength, None


class StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad):
        return grad


class Swish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return grad * (s * (1 + x * (1 - s)))


class ScaledMul(torch.autograd.Function):
    @staticmethod
    def forward(x, w, scale):
        return x * w * scale

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, w, scale = inputs
        ctx.save_for_backward(x, w)
        ctx.scale = scale

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        gx = grad * w * ctx.scale if ctx.needs_input_grad[0] else None
        gw = (grad * x * ctx.scale).sum(0) if ctx.needs_input_grad[1] else None
        return gx, gw, None


class ClampUnit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        ctx.save_for_backward((x > 0) & (x < 1))
        return x.clamp_(0, 1)

    @staticmethod
    def backward(ctx, grad):
        (inside,) = ctx.saved_tensors
        return grad * inside


class AdversarialNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 32)
        self.gain = nn.Parameter(torch.ones(32))
        self.task = nn.Linear(32, 4)
        self.domain = nn.Linear(32, 4)

    def forward(self, x):
        h = StraightThrough.apply(Swish.apply(self.a(x)))
        h = ScaledMul.apply(self.b(h), self.gain, 0.7)
        h = ClampUnit.apply(h.clone())
        return self.task(h) + 0.1 * self.domain(GradReverse.apply(h, 0.5))


def step(model, opt, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


@pytest.mark.parametrize("door", ["compile", "dynamo"])
def test_custom_autograd_functions_match_eager(fake_pg, door):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = AdversarialNet()
    twin = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    twin_opt = torch.optim.Adam(twin.parameters(), lr=0.01)
    compiled = (spmd_backend.compile()(step) if door == "compile" else
                torch.compile(step, backend="spmd", options={"inductor": False, "reduce_op": "sum"}))
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        torch.testing.assert_close(compiled(model, opt, x, y), step(twin, twin_opt, x, y))
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)
