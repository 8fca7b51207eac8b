"""Small models used by the tests, the demo and the benchmarks, with matching batch makers.

Every model is registered in :data:`MODELS` under a short name so that multi-rank jobs can
refer to it by a picklable string. Each entry builds the model and makes a batch for a given
seed; ``loss(model, batch)`` is the scalar the train step differentiates.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    """Linear/ReLU stack."""

    def __init__(self, dim: int = 32, hidden: int = 64, layers: int = 3, out: int = 8) -> None:
        super().__init__()
        dims = [dim] + [hidden] * (layers - 1) + [out]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.relu(x)
        return x


class OneLowPrecisionLayer(nn.Module):
    """float32 layers around one layer converted to ``dtype`` (``model.b.to(torch.bfloat16)``):
    ``dims`` = (input, hidden, output)."""

    def __init__(self, dtype: torch.dtype, dims: tuple[int, int, int] = (8, 32, 4)) -> None:
        super().__init__()
        d_in, hidden, d_out = dims
        self.a, self.b = nn.Linear(d_in, hidden), nn.Linear(hidden, hidden).to(dtype)
        self.c = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x)).to(self.b.weight.dtype)
        return self.c(self.b(h).float())


class DummyModel(nn.Module):
    """The seed test's model: ``layers`` x (Linear(dim, dim), ReLU) in one Sequential."""

    def __init__(self, layers: int, dim: int) -> None:
        super().__init__()
        modules: list[nn.Module] = []
        for _ in range(layers):
            modules.extend([nn.Linear(dim, dim), nn.ReLU()])
        self.mod = nn.Sequential(*modules)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mod(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        # no qkv bias: the key bias has an exactly-zero gradient, which Adam turns into noise
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        shape = (b, t, self.heads, c // self.heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A small GPT: token + position embedding, pre-LN blocks, tied output projection."""

    def __init__(
        self, vocab: int = 64, dim: int = 32, heads: int = 2, layers: int = 2, seq: int = 16
    ) -> None:
        super().__init__()
        self.seq = seq
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied input/output embedding
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class BatchNormNet(nn.Module):
    """Linear -> BatchNorm1d -> ReLU -> Linear: buffers updated by the forward."""

    def __init__(self, dim: int = 16, hidden: int = 32, out: int = 4) -> None:
        super().__init__()
        # no bias before BatchNorm: it would have an exactly-zero gradient
        self.fc1 = nn.Linear(dim, hidden, bias=False)
        self.bn = nn.BatchNorm1d(hidden)
        self.fc2 = nn.Linear(hidden, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.bn(self.fc1(x))))


class UnusedParamNet(nn.Module):
    """An MLP with a branch that never runs: its parameters never get a gradient."""

    def __init__(self, dim: int = 16, hidden: int = 32, out: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.unused = nn.Linear(hidden, hidden)
        self.fc2 = nn.Linear(hidden, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


class FrozenNet(nn.Module):
    """An MLP whose first layer is frozen (requires_grad=False)."""

    def __init__(self, dim: int = 16, hidden: int = 32, out: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, out)
        for p in self.fc1.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


@dataclass(frozen=True)
class ModelEntry:
    """How to build a registered model, make its batches and compute its loss.

    ``loss_fn`` overrides the default loss (for models whose forward takes a dict batch and
    returns their own loss). ``zero_gradient(name, param)`` returns the index of a parameter's
    part whose gradient is mathematically zero (an attention key bias: softmax ignores a
    per-row constant), or None; Adam turns the rounding noise there into +-lr steps, so parity
    checks compare that part only for being bounded.
    """

    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], Any]
    find_unused_parameters: bool = False
    language_model: bool = False
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None
    zero_gradient: Callable[[str, torch.Tensor], Any] | None = None

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        if self.loss_fn is not None:
            return self.loss_fn(model, batch)
        out = model(batch)
        if self.language_model:  # next-token prediction on the batch itself
            return F.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]), batch[:, 1:].reshape(-1))
        return out.pow(2).mean()


def _gpt_batch(gen: torch.Generator, vocab: int = 64, seq: int = 16, bsz: int = 4) -> torch.Tensor:
    return torch.randint(0, vocab, (bsz, seq), generator=gen)


def _dense_batch(dim: int, bsz: int = 8) -> Callable[[torch.Generator], torch.Tensor]:
    return lambda gen: torch.randn(bsz, dim, generator=gen)


MODELS: dict[str, ModelEntry] = {
    "mlp": ModelEntry(build=lambda: MLP(32, 64, 3, 8), batch=_dense_batch(32)),
    "gpt": ModelEntry(build=lambda: GPT(vocab=64, dim=32, heads=2, layers=2, seq=16),
                      batch=_gpt_batch, language_model=True),
    "batchnorm": ModelEntry(build=lambda: BatchNormNet(16, 32, 4), batch=_dense_batch(16)),
    "unused": ModelEntry(build=lambda: UnusedParamNet(16, 32, 4), batch=_dense_batch(16),
                         find_unused_parameters=True),
    "frozen": ModelEntry(build=lambda: FrozenNet(16, 32, 4), batch=_dense_batch(16)),
    "dummy": ModelEntry(build=lambda: DummyModel(2, 32), batch=_dense_batch(32)),
}


def _register_third_party() -> None:
    from spmd_backend.testing.third_party import THIRD_PARTY_MODELS

    MODELS.update(THIRD_PARTY_MODELS)


_register_third_party()
