"""The SPMD invariants of a step graph, and the check the pass manager runs after every pass.

Analysis only: nothing here mutates a graph. Requires a plain ``fx.Graph`` (an ``IterGraph``
is one). Guarantees: :func:`verify_graph` raises :class:`~spmd_backend.errors.SpmdGraphError`
naming the pass (when given) and the offending node, and returns ``None`` otherwise.

The invariants:

* ``graph.lint()`` passes;
* every collective is consumed by exactly one ``wait_tensor`` and nothing else;
* nothing writes a tensor (or a view of its storage) that a collective still reads: from the
  collective to its wait (:mod:`spmd_backend.graph.aliasing`; the process group reads it
  asynchronously, so a write there races with the send);
* collectives that existed before a pass keep their relative order per process group
  (:func:`collective_order`), unless the pass declared ``reorders_collectives``;
* a fused optimizer kernel (``_fused_adam(w)``, ``_fused_sgd``, ``_fused_adagrad``, functional or
  in place) gets, in every tensor list, either nothing or one tensor per parameter with that
  parameter's shape (step counts: one element), all contiguous: torch's CPU kernels size every
  list by the parameter and read memory in order, checking neither, so a shorter state or
  gradient is read and written out of bounds (heap corruption, a crash later and elsewhere)
  and a transposed one is read wrong;
* every placeholder and call node that returns something has ``meta["val"]`` (a fake value);
* every node carries a phase annotation (:mod:`spmd_backend.graph.meta`).

:class:`GraphFacts` records, before a pass, which of these a graph satisfied, so that a
hand-built test graph without fake values or annotations can still be verified.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._prims_common import is_non_overlapping_and_dense_or_false as is_dense

from spmd_backend.errors import SpmdGraphError
from spmd_backend.graph import aliasing, ops
from spmd_backend.graph.meta import annotated


def collective_order(graph: fx.Graph) -> dict[str, list[fx.Node]]:
    """Collectives per process-group name, in graph order."""
    out: dict[str, list[fx.Node]] = {}
    for node in graph.nodes:
        if ops.is_collective(node):
            group = str(node.args[-1]) if node.args else "?"
            out.setdefault(group, []).append(node)
    return out


def _returns_nothing(node: fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and len(target._schema.returns) == 0


def has_val(node: fx.Node) -> bool:
    """Whether ``node`` has the fake value it should have (nodes that return nothing need none)."""
    if node.op not in ("placeholder", "call_function") or "val" in node.meta:
        return True
    return node.op == "call_function" and _returns_nothing(node)


@dataclass(frozen=True)
class GraphFacts:
    """Invariant-related facts of a graph before a pass (what the pass must preserve)."""

    collectives: dict[str, list[fx.Node]]
    all_vals: bool
    all_annotated: bool

    @classmethod
    def of(cls, graph: fx.Graph) -> GraphFacts:
        return cls(
            collectives=collective_order(graph),
            all_vals=all(has_val(n) for n in graph.nodes),
            all_annotated=all(annotated(n) for n in graph.nodes),
        )


def _check_waits(node: fx.Node, where: str) -> None:
    waits = [u for u in node.users if ops.is_wait(u)]
    if len(waits) != 1 or len(node.users) != 1:
        raise SpmdGraphError(
            f"{where}: collective {node.name} must be used by exactly one wait_tensor, "
            f"found users {[u.name for u in node.users]}"
        )


def _check_in_flight_writes(graph: fx.Graph, where: str) -> None:
    """Raise when a node writes storage an issued, not yet waited, collective reads."""
    in_flight: dict[fx.Node, tuple[fx.Node, set[fx.Node]]] = {}  # root -> (collective, waits)
    for node in graph.nodes:
        if ops.is_wait(node) and in_flight:
            for root in [r for r, (_, waits) in in_flight.items() if node in waits]:
                waits = in_flight[root][1]
                waits.discard(node)
                if not waits:
                    del in_flight[root]
        if in_flight:
            for target in aliasing.written(node):
                hit = in_flight.get(aliasing.alias_root(target))
                if hit is not None:
                    raise SpmdGraphError(
                        f"{where}: {node.name} writes {target.name}, which collective "
                        f"{hit[0].name} still reads (until {sorted(w.name for w in hit[1])}); "
                        "a write before the wait races with the send"
                    )
        if ops.is_collective(node):
            waits = set(aliasing.waits_of(node))
            for arg in pytree.tree_leaves(node.args):
                if isinstance(arg, fx.Node) and waits:
                    in_flight[aliasing.alias_root(arg)] = (node, set(waits))


def _step_list_positions(node: fx.Node) -> set[int]:
    """Positions, among a fused kernel's list arguments, of its step counts (``state_steps``:
    one scalar per parameter, whatever the parameter's shape)."""
    return {k for k, (name, _) in enumerate(ops.list_arguments(node)) if name == "state_steps"}


def _check_fused_shapes(node: fx.Node, where: str) -> None:
    """Raise when a fused optimizer kernel's lists do not match its parameters (when the nodes
    carry fake values; graphs without them are not checked)."""
    lists = [a for a in node.args if isinstance(a, (list, tuple))]
    if not lists:
        return
    params = [getattr(p, "meta", {}).get("val") for p in lists[0]]
    if not all(isinstance(v, torch.Tensor) for v in params):
        return
    steps = _step_list_positions(node)
    for index, items in enumerate(lists):
        for j, t in enumerate(items):
            v = getattr(t, "meta", {}).get("val")
            if not isinstance(v, torch.Tensor) or index in steps:
                continue
            pv = params[j] if j < len(params) else v
            if not is_dense(v) or (
                    index and v.shape == pv.shape and v.stride() != pv.stride()):
                raise SpmdGraphError(
                    f"{where}: {node.name} ({ops.op_name(node)}) gets {t.name} of shape "
                    f"{tuple(v.shape)} with strides {tuple(v.stride())} (list argument {index}) "
                    f"for a parameter with strides {tuple(pv.stride())}; torch's fused kernels "
                    "walk a parameter and its tensors as one flat array each, so they need one "
                    "dense layout")
    for index, items in enumerate(lists[1:], start=1):
        if not items or index in steps:
            continue
        vals = [getattr(t, "meta", {}).get("val") for t in items]
        if not all(isinstance(v, torch.Tensor) for v in vals):
            continue
        if len(vals) != len(params):
            raise SpmdGraphError(
                f"{where}: {node.name} ({ops.op_name(node)}) has {len(params)} parameters but "
                f"{len(vals)} tensors in its list argument {index}")
        for p, t, v, pv in zip(lists[0], items, vals, params):
            if tuple(v.shape) != tuple(pv.shape):
                raise SpmdGraphError(
                    f"{where}: {node.name} ({ops.op_name(node)}) updates {p.name} of shape "
                    f"{tuple(pv.shape)} with {t.name} of shape {tuple(v.shape)} (list argument "
                    f"{index}); torch's fused kernels do not check sizes and would read and "
                    "write out of bounds")


def _check_order(graph: fx.Graph, before: Mapping[str, Sequence[fx.Node]], where: str) -> None:
    after = collective_order(graph)
    for group, old in before.items():
        alive = set(after.get(group, ()))
        kept_old = [n for n in old if n in alive]
        kept = set(kept_old)
        kept_new = [n for n in after.get(group, ()) if n in kept]
        if kept_old != kept_new:
            first = next(a for a, b in zip(kept_old, kept_new) if a is not b)
            raise SpmdGraphError(
                f"{where}: the relative order of collectives on group {group} changed "
                f"(first moved: {first.name}); declare reorders_collectives=True if intended"
            )


def verify_graph(
    graph: fx.Graph,
    *,
    pass_name: str = "",
    before: Mapping[str, Sequence[fx.Node]] | None = None,
    may_reorder: bool = False,
    require_vals: bool = True,
    require_annotations: bool = True,
    lint: bool = True,
) -> None:
    """Check the SPMD invariants (see the module docstring).

    ``before``: the :func:`collective_order` of the graph before the pass (order is checked only
    when given and ``may_reorder`` is false); ``require_vals`` / ``require_annotations``: check
    fake values / phase annotations; ``lint=False`` when the caller just linted the graph.
    """
    where = f"after pass {pass_name!r}" if pass_name else "in graph"
    if lint:
        graph.lint()
    for node in graph.nodes:
        if ops.is_collective(node):
            _check_waits(node, where)
        elif ops.is_fused_optimizer_kernel(node):
            _check_fused_shapes(node, where)
        if require_vals and not has_val(node):
            raise SpmdGraphError(f"{where}: node {node.name} has no meta['val']")
        if require_annotations and not annotated(node):
            raise SpmdGraphError(
                f"{where}: node {node.name} has no phase annotation (spmd_backend.graph.meta)"
            )
    _check_in_flight_writes(graph, where)
    if before is not None and not may_reorder:
        _check_order(graph, before, where)
