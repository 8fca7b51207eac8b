"""Sharded optimizer state in the Dynamo door: ``options={"shard_optimizer": True}``.

The compile door runs the user's ``optimizer.step()`` on shards by swapping the optimizer's
params and state around its own trace (:mod:`spmd_backend.tracing.sharding`). Dynamo traces
``step()`` itself, against the live state, so the swap happens one level lower: every torch.optim
optimizer of :data:`~spmd_backend.tracing.sharding.SHARDABLE` hands its update to a module-level
functional (``torch.optim.adam.adam(params, grads, exp_avgs, ...)``, ``sgd.sgd``, ...) whose
first two arguments are the parameters and their gradients, and whose state lists hold the live
state tensors. While Dynamo traces a frame for the spmd backend with sharding on, the scope
(:mod:`spmd_backend.dynamo.scope`) inlines :func:`sharded_update` in place of each such call::

    adam(params, grads, exp_avgs, ...)          # as the optimizer's step() wrote it
      -> s_i = local_shard(p_i)                 # [c_i]: this rank's slice, flattened, padded
         g_i = grad_shard(grads[i], fqn_i, rank, W)   # reduce_scatter after expansion
         adam([s_i...], [g_i...], exp_avgs, ...)      # state lists are already shards
         p_i.copy_(param_gather(s_i, fqn_i, W)[:n_i].view_as(p_i))   # all_gather

Before that trace, :func:`prepare` shards the live state of the frame's optimizers (and
installs the full-state ``state_dict`` hooks, :mod:`spmd_backend.parallel.sharded_state`), so the
state Dynamo reads, guards on and updates is each rank's shard. Parameters that stay replicated
(:meth:`ShardSpec.shards`: 0-dim, fewer elements than ranks) pass through unchanged, as in the
compile door. The markers' FQNs come from the parameters' graph inputs (the same
``source_fqn`` the gradient markers use), so the data-parallel expansion pairs each
``grad_shard`` with its ``grad_ready`` and issues a reduce_scatter instead of an all_reduce.

Requires: torch 2.13's optimizer functionals (checked by name and signature at import: a
missing one is simply not intercepted) and a process group. Guarantees: only calls made while a
sharded frame is traced are redirected; the update itself is the optimizer's own code.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

import torch

from spmd_backend.dynamo.graphs import source_fqn
from spmd_backend.errors import SpmdUsageError
from spmd_backend.parallel.sharded_state import prepare_sharding
from spmd_backend.tracing.markers import GRAD_SHARD, PARAM_GATHER, local_shard
from spmd_backend.tracing.sharding import SHARDABLE, ShardSpec, is_sharded

#: how this door spells the option in messages
OPTION = 'backend="spmd" options={"shard_optimizer": True}'


def _functionals() -> dict[Callable[..., Any], str]:
    """The update functional of every shardable optimizer, with its name: the module-level
    function named like its module (``torch.optim.adam.adam``) taking ``params, <grads>, ...``."""
    found: dict[Callable[..., Any], str] = {}
    for name in SHARDABLE:
        cls = getattr(torch.optim, name, None)
        module = importlib.import_module(cls.__module__) if cls is not None else None
        fn = getattr(module, module.__name__.rsplit(".", 1)[-1], None) if module else None
        if not callable(fn):
            continue
        params = list(inspect.signature(fn).parameters)
        if len(params) >= 2 and params[0] == "params":
            found[fn] = f"{module.__name__}.{fn.__name__}"
    return found


#: the functionals :func:`sharded_update` stands in for
FUNCTIONALS = _functionals()


def sharded_update(
    fn: Callable[..., Any], rank: int, world: int, fqns: tuple[str, ...],
    params: list[torch.Tensor], grads: list[torch.Tensor], *args: Any, **kwargs: Any,
) -> Any:
    """``fn(params, grads, *args, **kwargs)`` on this rank's shards (traced by Dynamo; see the
    module docstring). ``fqns[i]`` names ``params[i]``."""
    shards: list[torch.Tensor] = []
    shard_grads: list[torch.Tensor] = []
    gathered: list[tuple[torch.Tensor, torch.Tensor, str]] = []
    for p, g, fqn in zip(params, grads, fqns):
        if is_sharded(p.dim(), p.numel(), world):
            s = local_shard(p.detach(), rank, world)
            shards.append(s)
            shard_grads.append(GRAD_SHARD(g, fqn, rank, world))
            gathered.append((p, s, fqn))
        else:
            shards.append(p)
            shard_grads.append(g)
    out = fn(shards, shard_grads, *args, **kwargs)
    for p, s, fqn in gathered:
        p.copy_(PARAM_GATHER(s, fqn, world)[: p.numel()].view(p.shape))
    return out


def param_fqns(params: Any, what: str) -> tuple[str, ...]:
    """Names for a Dynamo list of parameters: the FQN read off a graph input's source (the name
    the gradient markers use, so expansion pairs them), else ``<what>[i]`` (a parameter the
    graph holds as an attribute, in a per-graph optimizer step: its gradient is an input
    there, all-reduced by its backward graph, and the expansion slices it)."""
    names: list[str] = []
    for i, var in enumerate(getattr(params, "items", ())):
        try:
            node = var.as_proxy().node
        except Exception:  # noqa: BLE001 - not a tensor variable
            node = None
        grapharg = node.meta.get("grapharg") if node is not None and node.op == "placeholder" else None
        source = getattr(grapharg, "source", None)
        names.append(source_fqn(source) if source is not None else f"{what}[{i}]")
    return tuple(names)


def spec_for(options: dict[str, Any] | None) -> tuple[ShardSpec, Any] | None:
    """This rank's :class:`ShardSpec` and the data-parallel group when ``options`` ask for
    sharded optimizer state; None otherwise, and for options the backend will refuse (invalid
    ones, no process group: it raises the same error when it parses them, as a backend error)."""
    if not (options or {}).get("shard_optimizer"):
        return None
    from spmd_backend.pipeline import PipelineConfig

    try:
        group = PipelineConfig.from_options(options, door="dynamo").parallel.process_group()
    except SpmdUsageError:
        return None
    spec = ShardSpec(torch.distributed.get_rank(group), torch.distributed.get_world_size(group))
    return spec, group


def prepare(optimizers: list[Any], spec: ShardSpec, group: Any) -> None:
    """Refuse an optimizer sharding cannot serve, install the full-state ``state_dict`` hooks
    and shard the live state of each optimizer (idempotent)."""
    for opt in optimizers:
        if isinstance(opt, torch.optim.Optimizer):
            prepare_sharding(opt, group, spec, OPTION)


__all__ = ["FUNCTIONALS", "OPTION", "param_fqns", "prepare", "sharded_update", "spec_for"]
