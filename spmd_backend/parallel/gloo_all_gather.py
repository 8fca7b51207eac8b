"""One all_gather in flight at a time on gloo: a wait moved up before the next all_gather.

torch 2.13's gloo process group corrupts the heap when two ``all_gather_into_tensor`` run at
once on its two worker threads (both through ``allgather_into_tensor_coalesced``): glibc aborts
("malloc(): unaligned tcache chunk detected", "double free or corruption") or a rank segfaults,
in that collective or in any later allocation, far from the cause. Reproduced without this
package (2 loopback ranks, nine small functional all_gathers issued, then waited: a crash
within 2,000 iterations; the same with every all_gather waited before the next, or with only
all_reduces in flight: 10,000 iterations clean; docs/reliability.md). The sharded optimizer
issues one all_gather per parameter (or bucket) and waits where the gathered parameter is
first read, so several were in flight on every step.

:func:`serialize_all_gathers` rewrites a graph so that on a process group that runs the
collective's tensors on gloo, every all_gather's wait comes before the next all_gather on that
group is issued (the wait moves up; nothing else moves, so the order of collectives, and what
runs between an all_gather and its wait, other collectives included, stay as they were).
Lowering keeps that order: Inductor's ``reorder_for_locality`` would move a wait past the next
all_gather again, so :func:`~spmd_backend.lowering.inductor.step_graph_config` turns it off
for graphs :func:`keeps_all_gathers_apart` recognizes.
Requires: functional collectives with one ``wait_tensor`` each (the SPMD invariants); group
names the process group registry resolves. Guarantees: the graph computes the same values
(a wait only moves earlier; its input precedes it, its users follow its old place); graphs
without gloo all_gathers are untouched. What ``affected`` says decides which groups are
serialized (:func:`runs_on_gloo` by default; tests pass their own).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.fx as fx

from spmd_backend.graph import ops
from spmd_backend.graph.aliasing import waits_of

log = logging.getLogger(__name__)


def backend_is_gloo(pg: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether ``pg`` runs ``device`` tensors on gloo (False when it cannot say)."""
    gloo = getattr(dist, "ProcessGroupGloo", None)
    if gloo is None:
        return False
    try:
        return isinstance(pg._get_backend(device), gloo)
    except (RuntimeError, ValueError, AttributeError):
        return False


def runs_on_gloo(group_name: str, device: torch.device) -> bool:
    """Whether the process group named ``group_name`` runs ``device`` tensors on gloo (False
    for a group the registry does not know, such as a test's fake one)."""
    try:
        pg = dist.distributed_c10d._resolve_process_group(group_name)
    except (RuntimeError, ValueError, KeyError):
        return False
    return backend_is_gloo(pg, device)


def _device(node: fx.Node) -> torch.device:
    first = node.args[0]
    if isinstance(first, (list, tuple)):
        first = first[0] if first else None
    val = first.meta.get("val") if isinstance(first, fx.Node) else None
    return val.device if isinstance(val, torch.Tensor) else torch.device("cpu")


def max_all_gathers_in_flight(graph: fx.Graph) -> int:
    """The most all_gathers issued and not yet waited at one point of ``graph``, on any one
    process group (analysis only)."""
    open_: dict[str, set[fx.Node]] = {}
    most = 0
    for node in graph.nodes:
        if ops.is_wait(node):
            for gathers in open_.values():
                gathers.discard(node.args[0])  # type: ignore[arg-type]
        elif ops.is_all_gather(node):
            gathers = open_.setdefault(str(node.args[-1]), set())
            gathers.add(node)
            most = max(most, len(gathers))
    return most


def keeps_all_gathers_apart(graph: fx.Graph) -> bool:
    """Whether ``graph`` has all_gathers whose order must survive lowering: two or more on one
    group, each waited before the next is issued (what :func:`serialize_all_gathers` makes).
    Inductor's ``reorder_for_locality`` moves a wait past the next all_gather (measured: the
    fx graph's gather, wait, gather came out as gather, gather, wait), so the lowering turns it
    off for such a graph (:func:`spmd_backend.lowering.inductor.step_graph_config`)."""
    per_group: dict[str, int] = {}
    for node in graph.nodes:
        if ops.is_all_gather(node):
            group = str(node.args[-1])
            per_group[group] = per_group.get(group, 0) + 1
    return max(per_group.values(), default=0) >= 2 and max_all_gathers_in_flight(graph) == 1


def serialize_all_gathers(
    graph: fx.Graph, affected: Callable[[str, torch.device], bool] = runs_on_gloo
) -> int:
    """Move waits up so that no two all_gathers are in flight on an affected group at once;
    returns how many waits moved. See the module docstring."""
    in_flight: dict[str, list[fx.Node]] = {}  # group -> waits of its all_gathers not yet reached
    decided: dict[tuple[str, str], bool] = {}
    moved = 0
    for node in list(graph.nodes):
        if ops.is_wait(node):
            for waits in in_flight.values():
                if node in waits:
                    waits.remove(node)
            continue
        if not ops.is_all_gather(node):
            continue
        group = str(node.args[-1])
        device = _device(node)
        key = (group, str(device))
        if key not in decided:
            decided[key] = affected(group, device)
        if not decided[key]:
            continue
        for wait in in_flight.get(group, []):
            node.prepend(wait)  # the earlier all_gather completes before this one starts
            moved += 1
        in_flight[group] = waits_of(node)
    if moved:
        graph.lint()
        log.info("gloo: %d all_gather wait(s) moved up so that one all_gather is in flight at "
                 "a time (torch 2.13's gloo corrupts memory with two)", moved)
    return moved


__all__ = [
    "backend_is_gloo", "keeps_all_gathers_apart", "max_all_gathers_in_flight", "runs_on_gloo",
    "serialize_all_gathers",
]
