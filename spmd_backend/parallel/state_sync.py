"""DDP's constructor broadcast: every parameter and buffer from the group's first rank, once.

Both front doors call :func:`sync_module_states` with the tensors a step uses; each tensor is
broadcast the first time it is seen on a process group and never again (a later compiled step
of the same model, or another graph of the same ``torch.compile`` step, skips it). The record
is kept on the tensor itself (an attribute holding the group names), so it lives exactly as long
as the tensor and needs no process-wide table; a copied model (``copy.deepcopy``) is a new set
of tensors and is synced again, as DDP would on construction.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from spmd_backend.parallel.data_parallel import DataParallel

#: attribute on a synced tensor: the names of the process groups it was broadcast on
SYNCED_ATTR = "_spmd_synced_groups"


def sync_module_states(tensors: Iterable[Any], mode: DataParallel) -> int:
    """Broadcast each tensor not yet synced on ``mode``'s group; returns how many were."""
    pg = mode.process_group()
    name = pg.group_name
    todo: list[torch.Tensor] = []
    seen: set[int] = set()
    for t in tensors:
        if not isinstance(t, torch.Tensor) or id(t) in seen:
            continue
        seen.add(id(t))
        if name not in getattr(t, SYNCED_ATTR, ()):
            todo.append(t)
    if dist.get_world_size(pg) > 1:
        src = mode.src_rank()
        with torch.no_grad():
            for t in todo:
                dist.broadcast(t.detach(), src=src, group=pg)
    for t in todo:
        setattr(t, SYNCED_ATTR, frozenset(getattr(t, SYNCED_ATTR, ())) | {name})
    return len(todo)
