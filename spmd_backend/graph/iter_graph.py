"""IterGraph: a step graph that records which work runs in the next iteration, and the graphs
derived from it.

Requires an ``fx.Graph`` of one training iteration. Guarantees:

* :class:`IterGraph` is an ordinary ``fx.Graph`` (every fx edit works: insert, erase, move,
  replace uses; :meth:`IterGraph.adopt` turns a graph into one in place) that also records
  cross-iteration moves made with :meth:`IterGraph.move_to_next_iter_before`.
* A move is refused (:class:`~spmd_backend.errors.SpmdPassError`) when the nodes are not a leaf
  subgraph, feed the graph's outputs, or touch state (a placeholder they write, or one written
  elsewhere that they read) that another node accesses before the target or after the moved
  nodes' original position: such a move could not reproduce the unmoved results.
* :func:`derive` builds the graphs each kind of call runs from the one graph and its moves
  (:data:`GRAPH_KINDS` says what each contains), so they can never drift apart. Moving ``S``
  before ``T`` means iteration i+1 runs iteration i's copy of ``S`` just before ``T``::

      one iteration:   A  B  T  C  [S]  D          (S = moved nodes, T = target)
      setup   (i=0):   A  B  T  C       D   -> also returns S's inputs (carried)
      main    (i>0):   A  B [S'] T  C   D   -> S' runs on the carried inputs; returns new ones
      cleanup (last):  A  B [S'] T  C  [S]  D  -> nothing is left pending
      plain   (only):  A  B  T  C  [S]  D   -> a cycle of one call: the graph as traced
      flush:                [S']           -> the pending work alone

  The inputs ``S`` reads from outside itself are *carried*: the derived graphs take them as
  extra trailing placeholders and return their new values as a second output.

Nothing here runs a graph; :class:`spmd_backend.iter_graph_module.IterGraphModule` does.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.fx as fx
import torch.utils._pytree as pytree

from spmd_backend.errors import SpmdPassError
from spmd_backend.graph.meta import Phase, annotate
from spmd_backend.graph.utils import (
    get_output,
    is_leaf_subgraph,
    mutated_placeholders,
    node_inputs,
    node_order,
)


@dataclass
class IterMove:
    """One block of nodes moved before ``target`` of the next iteration."""

    nodes: list[fx.Node]
    target: fx.Node

    def alive(self) -> list[fx.Node]:
        return [n for n in self.nodes if not getattr(n, "_erased", False)]


class IterGraph(fx.Graph):
    """An ``fx.Graph`` that records which node blocks run in the next iteration."""

    moves: list[IterMove]

    @classmethod
    def adopt(cls, graph: fx.Graph) -> IterGraph:
        """Turn ``graph`` into an IterGraph in place (O(1): no nodes are copied)."""
        if not isinstance(graph, IterGraph):
            graph.__class__ = cls
            graph.moves = []  # type: ignore[attr-defined]
        return graph  # type: ignore[return-value]

    def moved_nodes(self) -> set[fx.Node]:
        return {n for m in self.moves for n in m.alive()}

    def move_to_next_iter_before(self, nodes: Sequence[fx.Node], target_node: fx.Node) -> None:
        """Run ``nodes`` of iteration i just before ``target_node`` of iteration i+1."""
        nodes = list(dict.fromkeys(nodes))
        if not nodes:
            raise SpmdPassError("move_to_next_iter_before: no nodes to move")
        for n in [*nodes, target_node]:
            if n.graph is not self or getattr(n, "_erased", False):
                raise SpmdPassError(f"move_to_next_iter_before: {n.name} is not in this graph")
        if target_node.op == "placeholder":
            raise SpmdPassError("move_to_next_iter_before: the target cannot be a placeholder")
        members = set(nodes)
        if target_node in members:
            raise SpmdPassError(
                f"move_to_next_iter_before: the target {target_node.name} is among the moved nodes"
            )
        already = self.moved_nodes()
        if target_node in already or members & already:
            clash = sorted(n.name for n in (members | {target_node}) & already)
            raise SpmdPassError(f"move_to_next_iter_before: {clash} already moved")
        for n in nodes:
            if n.op in ("placeholder", "output"):
                raise SpmdPassError(f"move_to_next_iter_before: cannot move {n.op} {n.name}")
            if any(u.op == "output" for u in n.users):
                raise SpmdPassError(
                    f"move_to_next_iter_before: {n.name} feeds the graph's outputs; its value "
                    "would come from the previous iteration"
                )
        if not is_leaf_subgraph(self, nodes):
            outside = sorted(
                {u.name for n in nodes for u in n.users if u not in members and u.op != "output"}
            )
            raise SpmdPassError(
                "move_to_next_iter_before: the nodes are not a leaf subgraph; they are used by "
                f"{outside[:5]}"
            )
        order = node_order(self)
        self._check_state_hazards(nodes, target_node, order)
        nodes.sort(key=order.__getitem__)
        self.moves.append(IterMove(nodes=nodes, target=target_node))

    def _check_state_hazards(
        self, nodes: list[fx.Node], target: fx.Node, order: dict[fx.Node, int]
    ) -> None:
        members = set(nodes)
        # In the moved schedule the block's update lands at the target of the next iteration
        # instead of at its own position: an outside access sees the same state in both
        # schedules only if it lies between the target and the block ([start, end)).
        start = order[target]
        end = min(order[n] for n in nodes)
        written_inside = {p for n in nodes for p in mutated_placeholders(n)}
        written_outside: dict[fx.Node, fx.Node] = {}
        for n in self.nodes:
            if n not in members:
                for p in mutated_placeholders(n):
                    written_outside.setdefault(p, n)
        read_inside = {p for n in nodes for p in node_inputs(n) if p.op == "placeholder"}
        hazards = written_inside | (read_inside & set(written_outside))
        for p in sorted(hazards, key=order.__getitem__):
            for user in p.users:
                if user in members or user.op == "output":
                    continue
                pos = order[user]
                if not start <= pos < end:
                    when = "before the target" if pos < start else "after the moved block"
                    raise SpmdPassError(
                        f"move_to_next_iter_before: unsafe destination {target.name}: "
                        f"{p.name}, which the moved nodes "
                        f"{'update' if p in written_inside else 'read'}, is used by {user.name} "
                        f"{when}; move the block before the first use of {p.name} "
                        f"(or split it so that it touches only state used after {target.name})"
                    )


# ----------------------------------------------------------------------------- derivation
@dataclass(frozen=True)
class GraphKind:
    """What one derived graph contains, in terms of the one-iteration graph and its moves."""

    name: str
    #: the iteration itself: its placeholders, unmoved nodes and outputs (else only moved work)
    step: bool
    #: this iteration's moved nodes, at their own position
    moved_here: bool
    #: carried inputs as extra placeholders, and the previous call's moved nodes before targets
    carried_in: bool
    #: also return the values the moved nodes read, for the next call to carry
    carry_out: bool


#: every kind of derived graph (see the module docstring's sketch)
GRAPH_KINDS: dict[str, GraphKind] = {
    k.name: k
    for k in (
        GraphKind("setup", step=True, moved_here=False, carried_in=False, carry_out=True),
        GraphKind("main", step=True, moved_here=False, carried_in=True, carry_out=True),
        GraphKind("cleanup", step=True, moved_here=True, carried_in=True, carry_out=False),
        GraphKind("plain", step=True, moved_here=True, carried_in=False, carry_out=False),
        GraphKind("flush", step=False, moved_here=False, carried_in=True, carry_out=False),
    )
}


def _external_inputs(block: Sequence[fx.Node]) -> tuple[fx.Node, ...]:
    members = set(block)
    seen: dict[fx.Node, None] = {}
    for n in block:
        for a in node_inputs(n):
            if a not in members:
                seen.setdefault(a, None)
    return tuple(seen)


@dataclass(frozen=True)
class MovePlan:
    """The live moves of an IterGraph, validated: what every derived graph is built from."""

    blocks: tuple[tuple[fx.Node, ...], ...]
    targets: tuple[fx.Node, ...]
    #: per block, the values it reads from outside itself (carried from call to call)
    externals: tuple[tuple[fx.Node, ...], ...]

    @classmethod
    def of(cls, graph: IterGraph) -> MovePlan:
        moves = [(tuple(m.alive()), m.target) for m in graph.moves]
        moves = [(nodes, t) for nodes, t in moves if nodes]
        for _, t in moves:
            if getattr(t, "_erased", False):
                raise SpmdPassError(f"IterGraphModule: the move target {t.name} was erased")
        moved = {n for nodes, _ in moves for n in nodes}
        externals = tuple(_external_inputs(nodes) for nodes, _ in moves)
        if any(set(ext) & moved for ext in externals):
            raise SpmdPassError("IterGraphModule: a moved block reads another moved block")
        return cls(tuple(b for b, _ in moves), tuple(t for _, t in moves), externals)

    @functools.cached_property
    def moved(self) -> frozenset[fx.Node]:
        return frozenset(n for b in self.blocks for n in b)

    @functools.cached_property
    def carried(self) -> tuple[fx.Node, ...]:
        return tuple(e for ext in self.externals for e in ext)

    @functools.cached_property
    def by_target(self) -> dict[fx.Node, list[int]]:
        out: dict[fx.Node, list[int]] = {}
        for k, t in enumerate(self.targets):
            out.setdefault(t, []).append(k)
        return out


class _Builder:
    """Builds one derived graph of one kind (see :func:`derive`)."""

    def __init__(self, graph: fx.Graph, plan: MovePlan, kind: GraphKind) -> None:
        self.source, self.plan, self.kind = graph, plan, kind
        self.g = fx.Graph()
        self.env: dict[fx.Node, fx.Node] = {}
        self.carry: list[dict[fx.Node, fx.Node]] = []  # per block: external -> placeholder

    def copy(self, node: fx.Node) -> None:
        self.env[node] = self.g.node_copy(node, self.env.__getitem__)

    def add_carry_placeholders(self) -> None:
        for k, ext in enumerate(self.plan.externals):
            local: dict[fx.Node, fx.Node] = {}
            for j, e in enumerate(ext):
                ph = self.g.placeholder(f"carry{k}_{j}_{e.name}")
                ph.meta.update({key: v for key, v in e.meta.items() if key in ("val", "spmd_fqn")})
                annotate(ph, fqn=e.meta.get("spmd_fqn"), phase=Phase.INPUT)
                local[e] = ph
            self.carry.append(local)

    def clone_previous(self, k: int) -> None:
        """The previous call's copy of moved block ``k``, on the carried inputs."""
        local = dict(self.carry[k])
        for n in self.plan.blocks[k]:
            local[n] = self.g.node_copy(n, local.__getitem__)

    def clone_previous_before(self, node: fx.Node) -> None:
        if self.kind.carried_in:
            for k in self.plan.by_target.get(node, ()):
                self.clone_previous(k)

    def build(self) -> fx.Graph:
        kind, plan, nodes = self.kind, self.plan, list(self.source.nodes)
        if kind.step:
            for n in nodes:
                if n.op == "placeholder":
                    self.copy(n)
        if kind.carried_in:
            self.add_carry_placeholders()
        result: Any = []
        if not kind.step:
            for k in range(len(plan.blocks)):
                self.clone_previous(k)
        else:
            for n in nodes:
                if n.op in ("placeholder", "output"):
                    continue
                self.clone_previous_before(n)
                if kind.moved_here or n not in plan.moved:
                    self.copy(n)
            out_node = get_output(self.source)
            self.clone_previous_before(out_node)
            original = pytree.tree_map(
                lambda a: self.env[a] if isinstance(a, fx.Node) else a, out_node.args[0]
            )
            result = (original, [self.env[e] for e in plan.carried] if kind.carry_out else [])
        annotate(self.g.output(result), fqn=None, phase=Phase.OUTPUT)
        return self.g


class DerivedGraphs:
    """The graphs derived from an IterGraph and its moves, each built on first access
    (``derived["main"]``)."""

    def __init__(self, graph: fx.Graph, plan: MovePlan) -> None:
        self._graph, self.plan = graph, plan
        self._built: dict[str, fx.Graph] = {}

    @property
    def n_carried(self) -> int:
        return len(self.plan.carried)

    def __getitem__(self, kind: str) -> fx.Graph:
        if kind not in self._built:
            self._built[kind] = _Builder(self._graph, self.plan, GRAPH_KINDS[kind]).build()
        return self._built[kind]


def derive(graph: IterGraph) -> DerivedGraphs:
    """Validate the moves of ``graph`` and return its derived graphs (built lazily)."""
    return DerivedGraphs(graph, MovePlan.of(graph))
