"""Sharded optimizer state (ZeRO-style) inside a traced step: ``optimizer.step()`` on shards.

With ``DataParallel(shard_optimizer=True)`` the tracer runs the user's ``optimizer.step()`` on
this rank's shard of every parameter that has a gradient. For a parameter ``p`` of ``n``
elements on ``W`` ranks, ``c = ceil(n / W)`` (the flattened parameter zero-padded to ``W * c``)::

    g_s = grad_shard(p.grad, fqn, rank, W)     # [c] slice of the reduced gradient (marker)
    s   = pad(p.flatten())[rank*c : (rank+1)*c]  # [c] copy; s.grad = g_s
    optimizer.step()                             # on s, with p's state (shard-shaped tensors)
    p.copy_(param_gather(s, fqn, W)[:n].view_as(p))   # every rank's s, in rank order (marker)

The optimizer is the user's own object, with its param groups, hyper-parameters and
implementation unchanged; only the ``params`` lists and the state's keys point at the shards
while ``step()`` runs, so every elementwise update (the Adam family, SGD, RMSprop, Adagrad, ...)
computes exactly what it computes on the full tensor, element by element. Parameters with fewer
elements than ranks, and 0-dim ones, stay replicated (:meth:`ShardSpec.shards`). Optimizers whose
update mixes elements (LBFGS, Adafactor, Muon, SparseAdam) are refused by
:func:`check_shardable`. The data-parallel layer expands both markers into collectives.

Requires: the optimizer already swapped to the trace's tensors
(:mod:`spmd_backend.tracing.optimizer_swap` calls :meth:`ShardedStep.enter` and
:meth:`ShardedStep.exit` from its step hooks). Guarantees: after ``exit`` the param groups and
state keys are the (functional) full parameters again and each state tensor is shard-shaped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from spmd_backend.errors import SpmdUsageError
from spmd_backend.tracing.markers import GRAD_SHARD, PARAM_GATHER, local_shard, shard_numel

#: optimizers whose update is elementwise in the parameter, gradient and per-parameter state
SHARDABLE = frozenset({
    "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta",
    "ASGD", "Rprop",
})


def is_sharded(dim: int, numel: int, world: int) -> bool:
    """Whether a parameter of ``dim`` dimensions and ``numel`` elements is sharded over ``world``
    ranks: it has a dimension and at least one element per rank (smaller and 0-dim parameters
    stay replicated: all-reduced and updated on every rank, as without sharding)."""
    return world > 1 and dim >= 1 and numel >= world


@dataclass(frozen=True)
class ShardSpec:
    """This rank's place in the sharding: ``rank`` of ``world`` (the data-parallel group's)."""

    rank: int
    world: int

    def shards(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is sharded (:func:`is_sharded`)."""
        return is_sharded(param.dim(), param.numel(), self.world)

    def chunk(self, numel: int) -> int:
        return shard_numel(numel, self.world)

    def shard_of(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's slice of ``t`` flattened and zero-padded (a new tensor)."""
        return local_shard(t, self.rank, self.world)

    def is_shard_of(self, state: torch.Tensor, param: torch.Tensor) -> bool:
        """``state`` (of a sharded ``param``) has the shape of a shard."""
        return tuple(state.shape) == (self.chunk(param.numel()),)


#: how the compile door spells the option in messages
COMPILE_DOOR_OPTION = "DataParallel(shard_optimizer=True)"


def check_shardable(optimizer: torch.optim.Optimizer, option: str = COMPILE_DOOR_OPTION) -> None:
    """Refuse an optimizer whose update is not elementwise (sharding would change its result);
    messages start with ``option``, the option as the user spelled it."""
    name = type(optimizer).__name__
    if not any(type(optimizer) is getattr(torch.optim, n, None) for n in SHARDABLE):
        raise SpmdUsageError(
            f"{option}: {name} is not supported; sharding the "
            "optimizer state needs an update that is elementwise in each parameter, which "
            f"torch.optim's {', '.join(sorted(SHARDABLE))} are (a subclass or another optimizer "
            "may mix elements: run it with shard_optimizer=False)"
        )
    for g, group in enumerate(optimizer.param_groups):
        if group.get("differentiable"):
            raise SpmdUsageError(
                f"{option}: param group {g} of {name} is "
                "differentiable=True, which sharding does not support"
            )


class ShardedStep:
    """Points the optimizer at shards for one ``step()`` and gathers the updated shards back."""

    def __init__(self, spec: ShardSpec, names: dict[int, str]) -> None:
        self.spec = spec
        #: id(functional parameter) -> its state-dict name
        self.names = names
        self._groups: list[tuple[Any, list[torch.Tensor]]] = []
        self._live: list[tuple[torch.Tensor, torch.Tensor]] = []

    def enter(self, optimizer: torch.optim.Optimizer) -> None:
        spec = self.spec
        state = optimizer.state
        for group in optimizer.param_groups:
            params = list(group["params"])
            shards: list[torch.Tensor] = []
            for p in params:
                if p.grad is None or not spec.shards(p):
                    shards.append(p)
                    continue
                with torch.no_grad():
                    s = spec.shard_of(p.detach())
                s.grad = GRAD_SHARD(p.grad, self.names[id(p)], spec.rank, spec.world)
                if p in state:
                    state[s] = state.pop(p)
                self._live.append((p, s))
                shards.append(s)
            self._groups.append((group, params))
            group["params"] = shards

    def exit(self, optimizer: torch.optim.Optimizer) -> None:
        groups, live = self._groups, self._live
        self._groups, self._live = [], []
        for group, params in groups:
            group["params"] = params
        state = optimizer.state
        for p, s in live:
            if s in state:
                state[p] = state.pop(s)
            with torch.no_grad():
                full = PARAM_GATHER(s, self.names[id(p)], self.spec.world)
                p.copy_(full[: p.numel()].view(p.shape))
