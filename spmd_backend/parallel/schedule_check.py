"""Every rank runs a graph with the same collectives, checked on each call once a step has several.

A compiled step caches one graph per key. When its cache holds graphs with different collective
schedules (their consistency digests differ: another set of parameters is reduced, in other
buckets), a choice that differs between ranks at one call, such as a non-tensor argument or a
layer skipped at random, makes the ranks run different cached graphs. No new graph is traced,
so no consistency round runs, and where the buckets happen to have the same sizes (two
same-shaped layers, one skipped on each rank) the all_reduces sum one parameter's gradient into
another's: training goes wrong silently (0.0065 off DDP in the probe that found it).

:class:`ScheduleBook` keeps such agreed digests: one per compiled step in the compile door
(its graph rounds agree them), one per frame and process group in the Dynamo door, whose
graphs have no consistency round of their own (there the book runs one, over the parameters
each whole-step graph reduces, in order).

Requires: a digest of the graph about to run that ranks agreed on when it was traced
(:func:`~spmd_backend.parallel.consistency.check_consistency`), and that every rank knows the
same set of agreed digests (each new one came from a round all ranks joined), so that all of
them start checking at the same call. Guarantees: :func:`agree_on_schedule` runs one all_reduce
of two int64 numbers before the graph's first collective and raises
:class:`~spmd_backend.errors.SpmdDistributedError` on every rank when the ranks' digests
differ (the sums of a code and its square are equal to world x code and world x code^2 only
when every rank's code is the same), so nothing is written and no other collective runs. The
numbers are CPU tensors (:func:`cpu_channel`): on a group without a CPU backend (NCCL alone) a
gloo group of the same ranks carries them, created at the first check (a call every rank of
the group makes), so the check never waits for the device's queued work; only where that group
cannot be created does it fall back to the device (a host synchronization per call).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from spmd_backend.errors import SpmdDistributedError
from spmd_backend.parallel import consistency
from spmd_backend.parallel.live_groups import forget_destroyed

log = logging.getLogger(__name__)

#: bits of the digest each rank contributes (its code is below 2**20, so world * code**2
#: stays exact in int64 for any world size below 2**22)
_CODE_BITS = 20


def schedule_code(digest: str) -> int:
    """A small positive integer standing for ``digest`` (a hex string)."""
    return int(digest[: _CODE_BITS // 4], 16) + 1


#: id of a process group -> (that group, the group that carries its checks' CPU tensors, their
#: device); by object, since a group destroyed and created again keeps its name
_CHANNELS: dict[int, tuple[dist.ProcessGroup, dist.ProcessGroup, torch.device]] = {}


def _has_cpu_backend(group: dist.ProcessGroup) -> bool:
    try:
        group._get_backend(torch.device("cpu"))
    except (RuntimeError, ValueError, AttributeError):
        return False
    return True


def cpu_channel(group: dist.ProcessGroup, device: torch.device) -> tuple[dist.ProcessGroup, torch.device]:
    """The group and device a check of ``group`` uses: ``group`` itself with CPU tensors when it
    has a CPU backend (gloo, ``"cuda:nccl,cpu:gloo"``), else a gloo group over the same ranks,
    made once (every rank of ``group`` must be calling), else ``group`` on ``device``."""
    known = _CHANNELS.get(id(group))
    if known is not None and known[0] is group:
        return known[1], known[2]
    if _has_cpu_backend(group):
        found = (group, torch.device("cpu"))
    else:
        try:
            side = dist.new_group(dist.get_process_group_ranks(group), backend="gloo",
                                  use_local_synchronization=True)
            found = (side, torch.device("cpu"))
        except (RuntimeError, ValueError) as e:  # no gloo in this build: the device it is
            log.warning("spmd_backend: schedule checks of process group %s run on %s (a host "
                        "synchronization per check): no gloo group (%s)", group.group_name,
                        device, e)
            found = (group, device)
    forget_destroyed(_CHANNELS, lambda entry: entry[0])
    _CHANNELS[id(group)] = (group, *found)
    return found


def schedule_agrees(digest: str, group: dist.ProcessGroup, device: torch.device | None = None) -> bool:
    """Whether every rank of ``group`` passes the same ``digest`` (one all_reduce of two int64
    numbers; the same answer on every rank)."""
    world = dist.get_world_size(group)
    if world == 1 or dist.get_backend(group) == "fake":
        return True
    code = schedule_code(digest)
    channel, on = cpu_channel(group, device or torch.device("cpu"))
    sums = torch.tensor([code, code * code], dtype=torch.int64, device=on)
    dist.all_reduce(sums, group=channel)
    total, squares = (int(v) for v in sums.tolist())
    return world * squares == total * total


def agree_on_schedule(
    digest: str, group: dist.ProcessGroup, what: str, hint: str = "",
    device: torch.device | None = None, state: str = "Nothing was changed by this call.",
) -> None:
    """Raise on every rank of ``group`` unless every rank passes the same ``digest``
    (``device``: where the group's tensors live, used only without a CPU channel; ``state``:
    what the error says was left as it was)."""
    if not schedule_agrees(digest, group, device):
        raise SpmdDistributedError(
            f"spmd_backend: in this call of {what}, the ranks were about to run compiled graphs "
            "with different collectives: each would have reduced its gradients into other "
            "parameters' places. The step has cached graphs for several paths, and a choice "
            "that differs between the ranks picked one of them on each rank: a non-tensor "
            "argument, a value read from a tensor (.item(), bool(tensor)), or a layer skipped "
            "at random (LayerDrop). Data-parallel training needs every rank to take the same "
            f"path at each call. {state}{hint}"
        )


class ScheduleBook:
    """The agreed digests of a family of graphs that a rank's Python picks among at one call
    (one compiled step's cache; one Dynamo frame's whole-step graphs on one process group). A
    digest is added only after a consistency round every rank joined, so every rank's book is
    the same."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.digests: set[str] = set()

    def admit(self, lines: list[str], group: dist.ProcessGroup, timeout_s: float) -> str:
        """The digest of ``lines``; a digest not seen before is agreed with every rank first
        (:class:`SpmdDistributedError` on every rank when the ranks' lines differ)."""
        digest = consistency.signature_digest(lines)
        if digest in self.digests:
            return digest
        if dist.get_world_size(group) > 1 and dist.get_backend(group) != "fake":
            round_no = consistency.default_store().add(
                consistency.round_counter(group, "schedule"), 1)
            consistency.check_consistency(
                lines, f"{self.name} schedule#{round_no}", group, timeout_s,
                what="parameters reduced by the compiled graph",
                hint="\nEach rank compiled a graph that reduces other parameters: a choice "
                "that differs between the ranks (a Python argument, a branch on a tensor's "
                "value, LayerDrop) took another path on each. Data-parallel training needs "
                "every rank to take the same path.",
            )
        self.digests.add(digest)
        return digest

    def agreed(self, digest: str) -> bool:
        """Record ``digest``, agreed by a round of the caller's own (the compile door's graph
        round); True when it makes the book hold a second schedule (checks start)."""
        new = digest not in self.digests
        self.digests.add(digest)
        return new and len(self.digests) == 2

    def check(self, digest: str, group: dist.ProcessGroup, device: torch.device, what: str,
              hint: str = "") -> None:
        """:func:`agree_on_schedule` for a graph of the book, once it holds two or more digests
        (a graph outside it, one without collectives, is not checked)."""
        if len(self.digests) > 1 and digest in self.digests:
            agree_on_schedule(digest, group, what, hint, device)


__all__ = ["ScheduleBook", "agree_on_schedule", "cpu_channel", "schedule_agrees", "schedule_code"]
