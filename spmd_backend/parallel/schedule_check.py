"""Every rank runs a graph with the same collectives, checked on each call once a step has several.

A compiled step caches one graph per key. When its cache holds graphs with different collective
schedules (their consistency digests differ: another set of parameters is reduced, in other
buckets), a choice that differs between ranks at one call, such as a non-tensor argument or a
layer skipped at random, makes the ranks run different cached graphs. No new graph is traced,
so no consistency round runs, and where the buckets happen to have the same sizes (two
same-shaped layers, one skipped on each rank) the all_reduces sum one parameter's gradient into
another's: training goes wrong silently (0.0065 off DDP in the probe that found it).

Requires: a digest of the graph about to run that ranks agreed on when it was traced
(:func:`~spmd_backend.parallel.consistency.check_consistency`), and that every rank knows the
same set of agreed digests (each new one came from a round all ranks joined), so that all of
them start checking at the same call. Guarantees: :func:`agree_on_schedule` runs one all_reduce
of two int64 numbers before the graph's first collective and raises
:class:`~spmd_backend.errors.SpmdDistributedError` on every rank when the ranks' digests
differ (the sums of a code and its square are equal to world x code and world x code^2 only
when every rank's code is the same), so nothing is written and no other collective runs. On a
GPU it reads the result back (a host synchronization per call), which is why it runs only for
steps with several schedules.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from spmd_backend.errors import SpmdDistributedError

#: bits of the digest each rank contributes (its code is below 2**20, so world * code**2
#: stays exact in int64 for any world size below 2**22)
_CODE_BITS = 20


def schedule_code(digest: str) -> int:
    """A small positive integer standing for ``digest`` (a hex string)."""
    return int(digest[: _CODE_BITS // 4], 16) + 1


def agree_on_schedule(
    digest: str, group: dist.ProcessGroup, device: torch.device, what: str, hint: str = ""
) -> None:
    """Raise on every rank of ``group`` unless every rank passes the same ``digest``."""
    world = dist.get_world_size(group)
    if world == 1 or dist.get_backend(group) == "fake":
        return
    code = schedule_code(digest)
    sums = torch.tensor([code, code * code], dtype=torch.int64, device=device)
    dist.all_reduce(sums, group=group)
    total, squares = (int(v) for v in sums.tolist())
    if world * squares != total * total:
        raise SpmdDistributedError(
            f"spmd_backend: in this call of {what}, the ranks were about to run compiled graphs "
            "with different collectives: each would have reduced its gradients into other "
            "parameters' places. The step has cached graphs for several paths, and a choice "
            "that differs between the ranks picked one of them on each rank: a non-tensor "
            "argument, a value read from a tensor (.item(), bool(tensor)), or a layer skipped "
            "at random (LayerDrop). Data-parallel training needs every rank to take the same "
            f"path at each call. Nothing was changed by this call.{hint}"
        )


__all__ = ["agree_on_schedule", "schedule_code"]
