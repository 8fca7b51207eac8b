"""commit_writes_late: write graph inputs back after the last op that can still fail.

Requires: a step graph. Its writes into graph inputs that are *write-backs*,
``copy_(placeholder, value)`` nodes whose result nothing reads (AOTAutograd's input mutations,
the tracer's epilogue, an optimizer update that was not made in place), are what this pass moves;
in-place kernels (``_fused_adam_``, re-inplaced updates) stay where they are.

Guarantees: every write-back that comes before the graph's last fallible op
(:func:`spmd_backend.graph.commit.is_fallible`: collectives, waits, assertions, ...) is moved
right after that op, in its original order relative to the other moved write-backs, when

* nothing between its old and its new place reads or writes the same input (or a view of it),
  so every reader still sees the value it saw, and
* the value it writes is not a view of a graph input (which a moved write could change first).

The values written are the same; what changes is that a failure of a collective no longer
leaves those inputs half-updated, so the runtime snapshots fewer inputs before each call
(:mod:`spmd_backend.runtime`). With sharded optimizer state in the Dynamo door (each gathered
parameter and each state shard written back right after its own all_gather's wait) this is
the difference between snapshotting every parameter and state shard each call and nothing.
A graph without such write-backs is a logged no-op. ::

    before:  w0 = wait(ag0)  copy_(p0, view(w0))  w1 = wait(ag1)  copy_(p1, view(w1))
    after:   w0 = wait(ag0)  w1 = wait(ag1)  copy_(p0, view(w0))  copy_(p1, view(w1))
"""

from __future__ import annotations

import logging

import torch.fx as fx

from spmd_backend.graph import ops
from spmd_backend.graph.commit import is_fallible
from spmd_backend.graph.utils import node_order
from spmd_backend.pass_manager import declare_pass

log = logging.getLogger(__name__)


def _aliases(node: fx.Node) -> set[fx.Node]:
    """``node`` and every view of it (transitively)."""
    found, todo = {node}, [node]
    while todo:
        for user in todo.pop().users:
            if user not in found and ops.is_view(user):
                found.add(user)
                todo.append(user)
    return found


def _movable(copy: fx.Node, last: int, order: dict[fx.Node, int]) -> bool:
    dst, src = copy.args[0], copy.args[1]
    if copy.users or not isinstance(src, fx.Node) or ops.view_root(src).op == "placeholder":
        return False
    here = order[copy]
    for alias in _aliases(dst):
        if any(u is not copy and here < order[u] <= last for u in alias.users):
            return False
    return True


def commit_writes_late(gm: object) -> None:
    """Move write-backs into graph inputs after the last fallible op (see the module doc)."""
    graph: fx.Graph = gm.graph  # type: ignore[attr-defined]
    order = node_order(graph)
    nodes = list(graph.nodes)
    fallible = [n for n in nodes if is_fallible(n)]
    if not fallible:
        log.info("commit_writes_late: no op can fail; nothing to move")
        return
    last = order[fallible[-1]]
    candidates = [
        n for n in nodes[:last]
        if ops.is_copy_(n) and isinstance(n.args[0], fx.Node) and n.args[0].op == "placeholder"
    ]
    moved = [c for c in candidates if _movable(c, last, order)]
    anchor = fallible[-1]
    for copy in moved:
        anchor.append(copy)
        anchor = copy
    if moved:
        log.info("commit_writes_late: %d write-back(s) moved after %s (%d left before it)",
                 len(moved), fallible[-1].name, len(candidates) - len(moved))
    else:
        log.info("commit_writes_late: no write-back before %s can move", fallible[-1].name)


declare_pass(
    commit_writes_late,
    apply_after=["schedule_comm_wait", "remove_copy_from_optimizer", "split_fused_optimizer",
                 "iter_move_grads_and_optimizers"],
)
