"""The canonical train step of the tests, tools and docs: mean-square loss, backward, optimizer
step, zero_grad, return the loss (the README's step)."""

from __future__ import annotations

import torch
import torch.nn as nn


def train_step(model: nn.Module, optim: torch.optim.Optimizer, batch: torch.Tensor) -> torch.Tensor:
    loss = model(batch).pow(2).mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss
