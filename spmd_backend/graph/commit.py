"""Which graph inputs a failing step could leave half-updated (analysis only, never mutates).

A step that fails must leave the user's parameters, buffers, optimizer state and gradients
exactly as they were. A graph input is at risk when the graph writes it in place (a write-back
``copy_``, an in-place optimizer kernel) *before* an op that can still fail at run time:

* *fallible* ops are collectives and their waits (a peer failed), assertions
  (``_assert_async``: non-finite gradients), ``.item()``, ops that check indices against the
  data (embedding, gather, index, nll_loss, ...) and every op outside aten/prims (a custom op
  may raise anything); the backend's own identity markers are not;
* other aten ops can only fail on shapes, which the trace has already checked.

"Before" is graph order. The fx interpreter runs nodes in that order; Inductor keeps it for
the writes that matter here because step graphs compile with its peak-memory reordering off
(:data:`spmd_backend.lowering.inductor.STEP_GRAPH_CONFIG`): that reordering ran an earlier
bucket's update, which depends on nothing but its own bucket, before a later bucket's
collective, so a failure of the later one left the earlier parameters and moments written
without a snapshot. ``tests/test_failed_step.py`` checks both with Inductor (a fault before
the last wait, fused and single-tensor Adam). :func:`inputs_at_risk` returns the
placeholder positions to snapshot before a call and restore after a failure; for the default
pipeline only the optimizer's step counters (incremented before the gradients arrive).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.fx as fx

from spmd_backend.graph import ops
from spmd_backend.graph.utils import mutated_placeholders

aten = torch.ops.aten

#: aten ops that fail on their data (indices out of range, a failed assertion)
DATA_CHECKED_TARGETS: frozenset = frozenset(
    {
        aten._assert_async.default, aten._assert_async.msg, aten._assert_scalar.default,
        aten._functional_assert_async.msg, aten._local_scalar_dense.default,
        aten.embedding.default, aten.embedding_dense_backward.default,
        aten.gather.default, aten.scatter.src, aten.scatter.value, aten.scatter_add.default,
        aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
        aten.index_select.default, aten._unsafe_index.Tensor, aten.take.default,
        aten.nll_loss_forward.default, aten.nll_loss_backward.default,
        aten.nll_loss2d_forward.default, aten.nll_loss2d_backward.default,
        aten.nonzero.default, aten.masked_select.default, aten.repeat_interleave.Tensor,
    }
)


def is_fallible(node: fx.Node) -> bool:
    """Whether ``node`` can raise at run time for reasons the trace could not check."""
    if node.op in ("call_module", "call_method"):
        return True
    if node.op != "call_function":
        return False
    if ops.is_collective(node) or ops.is_wait(node) or node.target in DATA_CHECKED_TARGETS:
        return True
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.namespace not in ("aten", "prims", "spmd_backend")
    return not ops.is_getitem(node)


@dataclass(frozen=True)
class CommitRisk:
    """Placeholders written before a fallible op, and that op (for the log)."""

    positions: tuple[int, ...]
    names: tuple[str, ...]
    fallible_after: str | None


def inputs_at_risk(graph: fx.Graph) -> CommitRisk:
    """The placeholders a failure could leave half-written (see the module docstring)."""
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    position = {p: i for i, p in enumerate(placeholders)}
    last_fallible = max((i for i, n in enumerate(nodes) if is_fallible(n)), default=-1)
    at_risk: dict[fx.Node, str] = {}
    for n in nodes[: max(last_fallible, 0)]:
        for p in mutated_placeholders(n):
            at_risk.setdefault(p, nodes[last_fallible].name)
    ordered = sorted(at_risk, key=position.__getitem__)
    return CommitRisk(
        positions=tuple(position[p] for p in ordered),
        names=tuple(p.name for p in ordered),
        fallible_after=next(iter(at_risk.values()), None),
    )


def union(risks: Iterable[CommitRisk]) -> CommitRisk:
    positions: dict[int, str] = {}
    fallible = None
    for r in risks:
        positions.update(zip(r.positions, r.names))
        fallible = fallible or r.fallible_after
    ordered = sorted(positions)
    return CommitRisk(tuple(ordered), tuple(positions[i] for i in ordered), fallible)
