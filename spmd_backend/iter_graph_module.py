"""IterGraphModule: a train-step graph that can move work into the next iteration.

Requires an ``fx.GraphModule`` of one training iteration. Guarantees:

* ``gm.graph`` is an :class:`IterGraph`, an ordinary ``fx.Graph`` (every fx edit works: insert,
  erase, move, replace uses) that also records cross-iteration moves made with
  :meth:`IterGraph.move_to_next_iter_before`.
* The *setup*, *main* and *cleanup* graphs are derived from that one graph and its moves, so
  they can never drift apart: before :meth:`IterGraphModule.finalize_setup` they are rebuilt on
  every access (``setup_gm``/``main_gm``/``cleanup_gm``), after it they are frozen and lowered
  (Inductor when ``enable_inductor``).
* Moving ``nodes`` before ``target`` means iteration i+1 runs iteration i's copy of ``nodes``
  just before ``target``::

      one iteration:   A  B  T  C  [S]  D          (S = moved nodes, T = target)
      setup   (i=0):   A  B  T  C       D   -> also returns S's inputs (carried)
      main    (i>0):   A  B [S'] T  C   D   -> S' runs on the carried inputs; returns new ones
      cleanup (last):  A  B [S'] T  C  [S]  D  -> nothing is left pending

  The inputs S reads from outside itself are *carried* by reference from one call to the next.
* Calls: ``forward(*args, last_iter=False)``. The first call of a cycle runs setup (or, if it is
  also the last, the plain graph), later calls main, a ``last_iter=True`` call cleanup, after
  which the next call starts a new cycle. :meth:`flush` runs the pending work immediately (so a
  checkpoint taken mid-training loses nothing) and starts a new cycle. :attr:`pending_moves`
  tells how many moved blocks are pending.

A move is refused (:class:`~spmd_backend.errors.SpmdPassError`) when the nodes are not a leaf
subgraph, feed the graph's outputs, or touch state (a placeholder they write, or one written
elsewhere that they read) that another node accesses before ``target`` or after the moved
nodes' original position: such a move could not reproduce the unmoved results.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from spmd_backend.errors import SpmdPassError
from spmd_backend.graph.meta import Phase, annotate
from spmd_backend.graph.utils import (
    get_output,
    is_leaf_subgraph,
    make_graph_module,
    mutated_placeholders,
    node_inputs,
    node_order,
)

log = logging.getLogger(__name__)


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
class _Derived:
    """The graphs derived from an IterGraph and its moves, each built on first access."""

    KINDS = ("setup", "main", "cleanup", "plain", "flush")

    def __init__(self, builders: dict[str, Any], n_carried: int) -> None:
        self._builders = builders
        self._built: dict[str, fx.Graph] = {}
        self.n_carried = n_carried

    def __getattr__(self, kind: str) -> fx.Graph:
        builders = self.__dict__.get("_builders", {})
        if kind not in builders:
            raise AttributeError(kind)
        if kind not in self._built:
            self._built[kind] = builders[kind]()
        return self._built[kind]


def _external_inputs(block: list[fx.Node]) -> list[fx.Node]:
    members = set(block)
    seen: dict[fx.Node, None] = {}
    for n in block:
        for a in node_inputs(n):
            if a not in members:
                seen.setdefault(a, None)
    return list(seen)


def _derive(graph: IterGraph) -> _Derived:
    moves = [(m.alive(), m.target) for m in graph.moves]
    moves = [(nodes, t) for nodes, t in moves if nodes]
    for _, t in moves:
        if getattr(t, "_erased", False):
            raise SpmdPassError(f"IterGraphModule: the move target {t.name} was erased")
    moved = {n for nodes, _ in moves for n in nodes}
    externals = [_external_inputs(nodes) for nodes, _ in moves]
    for ext in externals:
        if set(ext) & moved:
            raise SpmdPassError("IterGraphModule: a moved block reads another moved block")
    carried = [e for ext in externals for e in ext]
    by_target: dict[fx.Node, list[int]] = {}
    for k, (_, t) in enumerate(moves):
        by_target.setdefault(t, []).append(k)
    out_node = get_output(graph)

    def build(*, keep_original: bool, run_carried: bool, return_carry: bool, only_moved: bool) -> fx.Graph:
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        carry_ph: list[fx.Node] = []

        def add_carry_placeholders() -> None:
            for k, ext in enumerate(externals):
                for j, e in enumerate(ext):
                    ph = g.placeholder(f"carry{k}_{j}_{e.name}")
                    ph.meta.update({kk: v for kk, v in e.meta.items() if kk in ("val", "spmd_fqn")})
                    annotate(ph, fqn=e.meta.get("spmd_fqn"), phase=Phase.INPUT)
                    carry_ph.append(ph)

        def clone_block(k: int) -> None:
            nodes = moves[k][0]
            start = sum(len(x) for x in externals[:k])
            local = dict(zip(externals[k], carry_ph[start : start + len(externals[k])]))
            for n in nodes:
                local[n] = g.node_copy(n, lambda a: local[a] if a in local else env[a])

        placeholders_done = False
        for node in graph.nodes:
            if node.op == "output":
                break
            if node.op == "placeholder":
                if not only_moved:
                    env[node] = g.node_copy(node, env.__getitem__)
                continue
            if not placeholders_done:
                placeholders_done = True
                if run_carried:
                    add_carry_placeholders()
                if only_moved:
                    for k in range(len(moves)):
                        clone_block(k)
                    break
            if run_carried:
                for k in by_target.get(node, ()):
                    clone_block(k)
            if node in moved and not keep_original:
                continue
            env[node] = g.node_copy(node, env.__getitem__)
        if not placeholders_done and run_carried:
            add_carry_placeholders()
            if only_moved:
                for k in range(len(moves)):
                    clone_block(k)
        if only_moved:
            result: Any = []
        else:
            if run_carried:
                for k in by_target.get(out_node, ()):
                    clone_block(k)
            original = pytree.tree_map(
                lambda a: env[a] if isinstance(a, fx.Node) else a, out_node.args[0]
            )
            carry_out = [env[e] for e in carried] if return_carry else []
            result = (original, carry_out)
        out = g.output(result)
        annotate(out, fqn=None, phase=Phase.OUTPUT)
        return g

    flags = {
        "setup": dict(keep_original=False, run_carried=False, return_carry=True, only_moved=False),
        "main": dict(keep_original=False, run_carried=True, return_carry=True, only_moved=False),
        "cleanup": dict(keep_original=True, run_carried=True, return_carry=False, only_moved=False),
        "plain": dict(keep_original=True, run_carried=False, return_carry=False, only_moved=False),
        "flush": dict(keep_original=False, run_carried=True, return_carry=False, only_moved=True),
    }
    return _Derived(
        {kind: functools.partial(build, **kw) for kind, kw in flags.items()}, len(carried)
    )


# ----------------------------------------------------------------------------- the module
class IterGraphModule(nn.Module):
    """See the module docstring. ``max_iters > 0`` makes call number ``max_iters`` the last."""

    def __init__(self, main_gm: fx.GraphModule, max_iters: int = -1, enable_inductor: bool = False) -> None:
        super().__init__()
        self._source = main_gm
        self._graph = IterGraph.adopt(main_gm.graph)
        self.max_iters = max_iters
        self.enable_inductor = enable_inductor
        self._finalized: _Derived | None = None
        self._modules_by_kind: dict[str, Any] = {}
        self._carried: list[Any] | None = None
        self._iter = 0
        self.cycles = 0

    # ------------------------------------------------------------------ graphs
    @property
    def graph(self) -> IterGraph:
        return self._graph

    @property
    def finalized(self) -> bool:
        return self._finalized is not None

    def iter_graphs(self) -> dict[str, fx.Graph]:
        """The graphs passes edit: the one IterGraph before finalize, the three after."""
        if self._finalized is None:
            return {"main": self._graph}
        return {k: self._gm(k).graph for k in ("setup", "main", "cleanup")
                if isinstance(self._gm(k), fx.GraphModule)}

    def source_graphs(self) -> dict[str, fx.Graph]:
        """The fx graphs each kind of call runs (before lowering): the one IterGraph before
        finalize, setup/main/cleanup after."""
        if self._finalized is None:
            return {"main": self._graph}
        return {k: getattr(self._finalized, k) for k in ("setup", "main", "cleanup")}

    def _gm_from(self, graph: fx.Graph) -> fx.GraphModule:
        graph._codegen = fx.graph.CodeGen()
        return make_graph_module(self._source, graph)

    def _derived_gm(self, kind: str) -> fx.GraphModule:
        derived = self._finalized or _derive(self._graph)
        return self._gm_from(getattr(derived, kind))

    def _gm(self, kind: str) -> Any:
        if self._finalized is None:
            return self._derived_gm(kind)
        if kind not in self._modules_by_kind:
            self._modules_by_kind[kind] = self._lower(self._gm_from(getattr(self._finalized, kind)), kind)
        return self._modules_by_kind[kind]

    @property
    def setup_gm(self) -> Any:
        return self._gm("setup")

    @property
    def main_gm(self) -> Any:
        return self._gm("main")

    @property
    def cleanup_gm(self) -> Any:
        return self._gm("cleanup")

    @property
    def num_moves(self) -> int:
        return len([m for m in self._graph.moves if m.alive()])

    @property
    def pending_moves(self) -> int:
        """How many moved blocks of the previous call still have to run."""
        return self.num_moves if self._carried is not None else 0

    def recompile(self) -> None:
        """Regenerate code: a no-op before finalize (graphs are derived on use)."""
        if self._finalized is not None:
            for mod in self._modules_by_kind.values():
                if isinstance(mod, fx.GraphModule):
                    mod.recompile()

    def _lower(self, gm: fx.GraphModule, kind: str) -> Any:
        if not self.enable_inductor or kind == "flush":
            return gm
        from spmd_backend.lowering import lower_to_inductor

        return lower_to_inductor(gm)

    def finalize_setup(self) -> None:
        """Freeze the graph: derive setup/main/cleanup (and flush), lower if asked.

    Each derived graph is built (and its code generated) when it first runs, so finalizing a
    large graph costs little until it is used; with ``enable_inductor`` the three graphs are
    built and compiled here.
    """
        if self._finalized is not None:
            return
        t0 = time.perf_counter()
        self._graph.lint()
        self._finalized = _derive(self._graph)  # validates; each graph is built on first use
        if self.enable_inductor:
            for kind in ("setup", "main", "cleanup"):
                self._gm(kind)
        log.info(
            "IterGraphModule finalized in %.2fs: %d moved block(s), %d carried value(s)%s",
            time.perf_counter() - t0,
            self.num_moves,
            self._finalized.n_carried,
            ", lowered to Inductor" if self.enable_inductor else "",
        )

    # ------------------------------------------------------------------ running
    def forward(self, *args: Any, last_iter: bool = False) -> Any:
        if self._finalized is None:
            log.info("IterGraphModule used before finalize_setup(); finalizing now")
            self.finalize_setup()
        # nothing of this module's own state changes until a graph returned: a failed call
        # can be retried (it re-runs the pending work on the inputs the caller restored)
        iteration = self._iter + 1
        if self.max_iters > 0 and iteration >= self.max_iters:
            last_iter = True
        if self._carried is None:
            if last_iter:
                out, _ = self._gm("plain")(*args)
                self._end_cycle()
                return out
            out, carried = self._gm("setup")(*args)
            self._carried, self._iter = list(carried), iteration
            return out
        if last_iter:
            out, _ = self._gm("cleanup")(*args, *self._carried)
            self._end_cycle()
            return out
        out, carried = self._gm("main")(*args, *self._carried)
        self._carried, self._iter = list(carried), iteration
        return out

    def _end_cycle(self) -> None:
        self._carried = None
        self._iter = 0
        self.cycles += 1

    def flush(self) -> None:
        """Run the pending moved work now; the next call starts a new cycle."""
        if self._carried is None:
            return
        if self._finalized is None:
            self.finalize_setup()
        with torch.no_grad():  # the moved work writes parameters/state in place, like a step
            self._gm("flush")(*self._carried)
        self._end_cycle()

    def __str__(self) -> str:
        state = "finalized" if self.finalized else "editable"
        return f"IterGraphModule({state}, {self.num_moves} moved block(s))\n{self._graph}"
