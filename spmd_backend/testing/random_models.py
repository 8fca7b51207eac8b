"""Random small models, optimizers and pass combinations for the randomized DDP-parity test.

:func:`random_case` turns a seed into a :class:`~spmd_backend.testing.parity.ParityCase` whose
model is a :class:`RandomModelSpec`: a stack of 1-3 blocks with random widths and activations,
optionally a tied (reused) layer, an unused branch and checkpointed blocks; an optimizer drawn
from the supported set; and a transformation (none, or the graph-optimization pipeline). All
choices are picklable, so a case runs on every rank of a RankPool.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn as nn

from spmd_backend.gm_transformation import GraphModuleTransformation
from spmd_backend.testing.parity import OptimSpec, ParityCase

_ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh}


class _Block(nn.Module):
    def __init__(self, dim_in: int, dim_out: int, act: str) -> None:
        super().__init__()
        self.fc = nn.Linear(dim_in, dim_out)
        self.act = _ACTIVATIONS[act]()

    def forward(self, x):
        return self.act(self.fc(x))


class RandomNet(nn.Module):
    def __init__(self, spec: RandomModelSpec) -> None:
        super().__init__()
        dims = [spec.dim_in, *spec.widths]
        self.blocks = nn.ModuleList(
            _Block(a, b, act) for a, b, act in zip(dims[:-1], dims[1:], spec.activations)
        )
        self.tied = spec.tied
        self.unused = nn.Linear(dims[-1], dims[-1]) if spec.unused_branch else None
        self.head = nn.Linear(dims[-1], spec.dim_out)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        if self.tied:  # the last block runs twice: its weights are shared by two uses
            x = self.blocks[-1](x)
        return self.head(x)


@dataclass(frozen=True)
class RandomModelSpec:
    """A picklable description of a random model (the ModelEntry interface of the parity test)."""

    dim_in: int
    widths: tuple[int, ...]
    activations: tuple[str, ...]
    dim_out: int
    tied: bool
    unused_branch: bool
    checkpointed: tuple[int, ...]
    batch_size: int
    seed: int

    @property
    def find_unused_parameters(self) -> bool:
        return self.unused_branch

    def build(self) -> nn.Module:
        from spmd_backend.tracing.checkpoint import checkpoint

        model = RandomNet(self)
        for i in self.checkpointed:
            checkpoint(model.blocks[i])
        return model

    def batch(self, gen: torch.Generator) -> torch.Tensor:
        return torch.randn(self.batch_size, self.dim_in, generator=gen)

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return model(batch).pow(2).mean()

    def describe(self) -> str:
        bits = [f"{self.dim_in}->{'->'.join(map(str, self.widths))}->{self.dim_out}",
                "/".join(self.activations)]
        if self.tied:
            bits.append("tied")
        if self.unused_branch:
            bits.append("unused-branch")
        if self.checkpointed:
            bits.append(f"ckpt{list(self.checkpointed)}")
        return " ".join(bits)


_OPTIMS = [
    OptimSpec("sgd", "foreach", lr=0.05),
    OptimSpec("sgd", "single", lr=0.05, momentum=0.9),
    OptimSpec("sgd", "fused", lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    OptimSpec("adam", "foreach", lr=1e-3),
    OptimSpec("adam", "fused", lr=1e-3),
    OptimSpec("adamw", "single", lr=1e-3, weight_decay=0.1),
    OptimSpec("adamw", "fused", lr=1e-3, weight_decay=0.1, param_groups=2, scheduler=True),
]


def random_case(seed: int, steps: int = 6) -> ParityCase:
    """A reproducible random model x optimizer x transformation case."""
    rng = random.Random(seed)
    depth = rng.randint(1, 3)
    widths = tuple(rng.choice([8, 16, 24, 32]) for _ in range(depth))
    tied = rng.random() < 0.3 and widths[-1] == (widths[-2] if depth > 1 else None)
    spec = RandomModelSpec(
        dim_in=rng.choice([8, 16]),
        widths=widths,
        activations=tuple(rng.choice(sorted(_ACTIVATIONS)) for _ in range(depth)),
        dim_out=rng.choice([2, 4]),
        tied=bool(tied),
        unused_branch=rng.random() < 0.3,
        checkpointed=tuple(i for i in range(depth) if rng.random() < 0.3),
        batch_size=rng.choice([4, 8]),
        seed=seed,
    )
    optim = rng.choice(_OPTIMS)
    optimize = rng.random() < 0.5
    transformation = GraphModuleTransformation(enable_graph_optimization=True) if optimize else None
    return ParityCase(model=spec, optim=optim, steps=steps, transformation=transformation, seed=seed)  # type: ignore[arg-type]
