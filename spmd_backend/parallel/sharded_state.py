"""The live optimizer state of ``DataParallel(shard_optimizer=True)``: shards per rank, full
state at the optimizer's state-dict boundary.

* :func:`shard_optimizer_state` replaces every full (parameter-shaped) state tensor of a sharded
  parameter (:meth:`~spmd_backend.tracing.sharding.ShardSpec.shards`) by this rank's shard:
  ``opt.state[p]["exp_avg"]`` then holds ``ceil(numel / world)`` elements. Scalar state
  (``step``) stays as it is. Called before every compiled call binds its inputs (state loaded
  or created eagerly is sharded on first use) and after ``load_state_dict``.
* :func:`install_state_dict_hooks` makes ``opt.state_dict()`` return the full state, equal to
  an unsharded optimizer's, on every rank (each shard all_gathered; every rank of the group must
  call ``state_dict()``, as with FSDP's full state dict: one that calls it alone raises after
  the consistency timeout, naming that), and ``opt.load_state_dict(full)``
  re-shard what it loaded. The live state is never modified by ``state_dict()``.

Requires an initialized process group (the data-parallel group). Errors name the parameter.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from spmd_backend.errors import SpmdDistributedError, SpmdUsageError
from spmd_backend.parallel import consistency
from spmd_backend.tracing.sharding import COMPILE_DOOR_OPTION, ShardSpec, check_shardable

#: the attribute marking an optimizer whose state-dict hooks are installed
HOOKS_ATTR = "_spmd_sharded_state"


def _params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Parameters in ``state_dict`` order (param groups, then position)."""
    return [p for group in opt.param_groups for p in group["params"]]


def shard_optimizer_state(opt: torch.optim.Optimizer, spec: ShardSpec) -> bool:
    """Shard every full state tensor of a sharded parameter; True when something changed."""
    changed = False
    for i, p in enumerate(_params(opt)):
        entries = opt.state.get(p)
        if not entries or not spec.shards(p):
            continue
        for k, v in list(entries.items()):
            if not isinstance(v, torch.Tensor) or v.dim() == 0 or spec.is_shard_of(v, p):
                continue
            if v.shape != p.shape:
                raise SpmdUsageError(
                    f"DataParallel(shard_optimizer=True): optimizer state {k!r} of parameter "
                    f"#{i} has shape {tuple(v.shape)}, neither the parameter's "
                    f"{tuple(p.shape)} nor a shard's ({spec.chunk(p.numel())},)"
                )
            with torch.no_grad():
                entries[k] = spec.shard_of(v)
            changed = True
    return changed


def _gathered(v: torch.Tensor, p: torch.Tensor, spec: ShardSpec, group: Any) -> torch.Tensor:
    out = v.new_empty(v.numel() * spec.world)
    dist.all_gather_into_tensor(out, v.contiguous(), group=group)
    return out[: p.numel()].view(p.shape).clone()


#: what a rank that calls ``state_dict()`` alone is told (after the others did not join)
_EVERY_RANK = (
    "the other rank(s) did not call it. A sharded optimizer's state_dict() gathers every "
    "rank's shard, so every rank must call it, as with FSDP's full state dict: call "
    "opt.state_dict() on every rank, then save it on one (`sd = opt.state_dict()` before "
    "`if rank == 0: torch.save(sd, ...)`)"
)


def full_state_dict(
    opt: torch.optim.Optimizer, state_dict: dict[str, Any], spec: ShardSpec, group: Any,
    timeout_s: float = consistency.DEFAULT_TIMEOUT_S,
) -> dict[str, Any]:
    """``state_dict`` with every shard replaced by the full tensor (a collective). The ranks
    first agree, through the store, that each of them is gathering the same tensors: a rank
    that calls ``state_dict()`` alone (``if rank == 0: torch.save(opt.state_dict())``, as DDP
    code does) raises after ``timeout_s`` naming the fix, instead of waiting in the all_gather
    for ranks that never join (30 minutes on gloo before its own timeout)."""
    params = _params(opt)
    gathers = [
        (index, k, p, v)
        for index, entries in state_dict["state"].items()
        for p in [params[index]] if spec.shards(p)
        for k, v in entries.items()
        if isinstance(v, torch.Tensor) and v.dim() > 0 and spec.is_shard_of(v, p)
    ]
    if gathers and dist.get_world_size(group) > 1 and dist.get_backend(group) != "fake":
        store = consistency.default_store()
        counter = consistency.round_counter(group, "state_dict")
        round_no = store.add(counter, 1)
        try:
            consistency.check_consistency(
                [f"{type(opt).__name__} state {i}.{k} {list(p.shape)}" for i, k, p, _ in gathers],
                f"sharded_state_dict#{round_no}", group, timeout_s,
                what="call of optim.state_dict()", missing_hint=_EVERY_RANK,
            )
        except SpmdDistributedError:
            store.add(counter, -1)  # this call did not happen: the next one pairs with theirs
            raise
    state = {index: dict(entries) for index, entries in state_dict["state"].items()}
    for index, k, p, v in gathers:
        state[index][k] = _gathered(v, p, spec, group)
    return {**state_dict, "state": state}


def install_state_dict_hooks(
    opt: torch.optim.Optimizer, spec: ShardSpec, group: Any,
    timeout_s: float = consistency.DEFAULT_TIMEOUT_S,
) -> None:
    """Make ``state_dict()`` full and ``load_state_dict()`` re-shard (once per optimizer)."""
    installed = getattr(opt, HOOKS_ATTR, None)
    if installed is not None:
        if installed != (spec, id(group)):
            raise SpmdUsageError(
                f"shard_optimizer=True: this {type(opt).__name__} is already "
                f"sharded as {installed[0]} over another group; one optimizer, one sharding"
            )
        return
    opt.register_state_dict_post_hook(
        lambda o, sd: full_state_dict(o, sd, spec, group, timeout_s)
    )
    opt.register_load_state_dict_post_hook(lambda o: shard_optimizer_state(o, spec) and None)
    setattr(opt, HOOKS_ATTR, (spec, id(group)))


def prepare_sharding(
    opt: torch.optim.Optimizer, group: Any, spec: ShardSpec | None,
    option: str = COMPILE_DOOR_OPTION, timeout_s: float = consistency.DEFAULT_TIMEOUT_S,
) -> tuple[ShardSpec, bool]:
    """Before a compiled call: refuse an optimizer sharding cannot serve, install the state-dict
    hooks (once), shard any full state; returns this rank's spec and whether state changed.
    ``option`` is the option as the user spelled it (for messages)."""
    check_shardable(opt, option)
    if spec is None:
        spec = ShardSpec(dist.get_rank(group), dist.get_world_size(group))
    install_state_dict_hooks(opt, spec, group, timeout_s)
    return spec, shard_optimizer_state(opt, spec)
