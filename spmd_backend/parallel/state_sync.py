"""DDP's constructor broadcast: every parameter and buffer from the group's first rank, once.

Both front doors call :func:`sync_module_states` with the tensors a step uses; each tensor is
broadcast the first time it is seen on a process group and never again (a later compiled step
of the same model, or another graph of the same ``torch.compile`` step, skips it). The record
is kept on the tensor itself (an attribute holding the group names), so it lives exactly as long
as the tensor and needs no process-wide table; a copied model (``copy.deepcopy``) is a new set
of tensors and is synced again, as DDP would on construction.

Before that first broadcast (and before any collective of a step that uses new tensors), with
``check_consistency`` on, the ranks compare the names, shapes and dtypes of the tensors they are
about to sync through the c10d store (:func:`~spmd_backend.parallel.consistency.check_consistency`),
as DDP's constructor verifies parameter shapes across processes: ranks whose models differ raise
:class:`~spmd_backend.errors.SpmdDistributedError` naming the first differing tensor, instead of
hanging in a broadcast or an all_reduce of mismatched sizes. The verification runs even when
``sync_module_states`` is off (the gradients' collectives would hang the same way). Rounds are
numbered per rank and group by a counter in the store, so no process-wide table is needed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from spmd_backend.parallel import consistency
from spmd_backend.parallel.data_parallel import DataParallel

#: attribute on a synced tensor: the names of the process groups it was broadcast on
SYNCED_ATTR = "_spmd_synced_groups"
#: attribute on a verified tensor: the names of the process groups whose ranks agreed on it
VERIFIED_ATTR = "_spmd_verified_groups"


def sync_module_states(
    tensors: Iterable[Any], mode: DataParallel, names: Sequence[str] | None = None, *,
    verify: bool = True,
) -> int:
    """Verify (``verify`` and ``mode.check_consistency``) each tensor not yet verified or
    broadcast on ``mode``'s group, then broadcast (``mode.sync_module_states``) each not yet
    broadcast; returns how many were. ``names`` (parallel to ``tensors``) name them in errors."""
    pg = mode.process_group()
    group = pg.group_name
    unsynced: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) or id(t) in seen:
            continue
        seen.add(id(t))
        if group not in getattr(t, SYNCED_ATTR, ()):
            unsynced.append((names[i] if names is not None else f"tensor {i}", t))
    fresh = [(n, t) for n, t in unsynced if group not in getattr(t, VERIFIED_ATTR, ())]
    if fresh and verify and mode.check_consistency:
        verify_across_ranks(fresh, pg, mode.consistency_timeout_s)
    for _, t in fresh:
        setattr(t, VERIFIED_ATTR, frozenset(getattr(t, VERIFIED_ATTR, ())) | {group})
    if not mode.sync_module_states or not unsynced:
        return 0
    if dist.get_world_size(pg) > 1:
        src = mode.src_rank()
        with torch.no_grad():
            for _, t in unsynced:
                dist.broadcast(t.detach(), src=src, group=pg)
    for _, t in unsynced:
        setattr(t, SYNCED_ATTR, frozenset(getattr(t, SYNCED_ATTR, ())) | {group})
    return len(unsynced)


def verify_across_ranks(
    named: Sequence[tuple[str, torch.Tensor]], pg: dist.ProcessGroup, timeout_s: float
) -> None:
    """Every rank of ``pg`` holds tensors of the same names, shapes and dtypes (in order), or
    every rank raises :class:`~spmd_backend.errors.SpmdDistributedError` naming the first
    difference (or the rank that never posted, after ``timeout_s``)."""
    if dist.get_world_size(pg) == 1 or dist.get_backend(pg) == "fake":
        return
    lines = [f"{name}: {list(t.shape)} {t.dtype}" for name, t in named]
    store = consistency.default_store()
    round_no = store.add(consistency.round_counter(pg, "state"), 1)
    consistency.check_consistency(lines, f"module_state#{round_no}", pg, timeout_s,
                                  what="module state (parameters and buffers)", hint=_READS_HINT)


#: what a difference in the tensors a step reads means when the models are the same
_READS_HINT = (
    "\nThese are the tensors each rank's step reads, compared before its first collective. "
    "If every rank built the same model, their steps read different tensors: a Python branch "
    "on a tensor's value went differently on the ranks (torch.compile traced each rank's own "
    "path), such as nn.AdaptiveLogSoftmaxWithLoss skipping a cluster, or a mixture of experts "
    "skipping an expert, that no target or token of this rank's batch reaches, or a layer "
    "skipped at random (LayerDrop: transformers' layerdrop, drawn on each rank). Data-parallel "
    "training needs every rank to take the same path: make the branch a tensor operation "
    "(torch.where, masking) or run every branch on every rank (LayerDrop: the same draw on "
    "every rank, or layerdrop=0). The same parameter under two names (a module's, and the "
    "optimizer's param_groups.g.params.i) means the ranks compiled different frames: code that "
    "splits the step on some ranks only, such as a print or a logging call under "
    "`if dist.get_rank() == 0:` before the forward, or an augmentation chosen per rank; move "
    "it out of the compiled step or after optimizer.step()."
)
