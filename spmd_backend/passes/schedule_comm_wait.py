"""schedule_comm_wait: issue collectives as early, and wait for them as late, as possible.

Requires: nothing beyond collective blocks (collective -> wait, fused or not): called directly it
works on any graph, and a graph without collectives is a logged no-op. Declared with the
prerequisite ``comm_fusion_with_concat`` (the upstream order: bucket first, then schedule the
buckets; scheduling first is valid but bucketing then waits where it builds each bucket).
Guarantees: each collective (with its input packing) is moved to right after the last node it
depends on, but never before an earlier collective of the same process group, so the order of
collectives is unchanged; each wait (with its split/getitem/view tail) is moved to right before
the first node that consumes the collective's result. Compute between the two overlaps the
communication.

::

    before:  mm_5  ar = all_reduce(g)  w = wait(ar)  mm_6  mm_7  ...  opt(w)
    after:   mm_5  ar = all_reduce(g)  mm_6  mm_7  ...  w = wait(ar)  opt(w)
"""

from __future__ import annotations

import logging

import torch.fx as fx

from spmd_backend.graph import ops
from spmd_backend.graph.comm import CommBlock, get_all_comm_blocks
from spmd_backend.graph.utils import node_order
from spmd_backend.pass_manager import declare_pass

log = logging.getLogger(__name__)


def _issue_early(graph: fx.Graph, block: CommBlock, floor: fx.Node | None) -> None:
    order = node_order(graph)
    anchors = [n for n in block.inputs if n.op != "get_attr"]
    if floor is not None:
        anchors.append(floor)
    if not anchors:
        return
    anchor = max(anchors, key=order.__getitem__)
    if anchor.op == "placeholder":
        # after the last placeholder (nodes may not precede placeholders)
        anchor = max((n for n in graph.nodes if n.op == "placeholder"), key=order.__getitem__)
    for node in reversed([*block.pre_nodes, block.comm_node]):
        if order[node] > order[anchor]:
            anchor.append(node)


def _wait_late(graph: fx.Graph, block: CommBlock) -> None:
    order = node_order(graph)
    members = set(block.node_list)
    consumers = [u for out in block.outputs for u in out.users if u not in members]
    if not consumers:
        return
    first = min(consumers, key=order.__getitem__)
    for node in [block.wait_node, *block.tail_nodes]:
        first.prepend(node)


def schedule_comm_wait(gm: object) -> None:
    """Move collectives early and waits late (see the module docstring)."""
    graph: fx.Graph = gm.graph  # type: ignore[attr-defined]
    blocks = get_all_comm_blocks(graph, ops.is_collective)
    if not blocks:
        log.info("schedule_comm_wait: no collective; nothing to do")
        return
    last_on_group: dict[str, fx.Node] = {}
    for block in blocks:  # graph order: each may move up to, never above, its predecessor
        _issue_early(graph, block, last_on_group.get(block.group))
        last_on_group[block.group] = block.comm_node
    for block in get_all_comm_blocks(graph, ops.is_collective):
        _wait_late(graph, block)
    log.info("schedule_comm_wait: scheduled %d collective(s)", len(blocks))


declare_pass(schedule_comm_wait, prerequisites=["comm_fusion_with_concat"])
