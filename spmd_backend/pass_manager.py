"""Pass declaration, ordering, verification and instrumentation.

One declaration (:class:`PassSpec`, made by :func:`declare_pass` or the legacy
:func:`graph_optimization_pass` decorator) serves two faces:

* :class:`PassManager` (the modern face): takes passes in any order, sorts them by their
  declared dependencies (networkx topological sort, stable in the given order), refuses missing
  prerequisites and cycles naming the passes involved, and runs each pass followed by the
  post-pass work: ``graph.lint()``, dead-code elimination that keeps side effects, recompile,
  verification of the SPMD invariants (:func:`verify_graph`), a timing log line and optional
  graph dumps. Passes can be skipped by name (``skip=`` or ``SPMD_SKIP_PASSES=a,b``); a pass
  whose prerequisite is skipped is skipped too. A manager owns no global state: two managers,
  or one manager on two graphs, never interfere.
* :func:`graph_optimization_pass` (the upstream seed's decorator): the same checks against the
  module-level set :data:`_optimized_func` (which callers reset with ``.clear()``), failing with
  ``AssertionError`` as the seed tests expect.

A pass is a function ``fn(gm, **kwargs)`` taking a ``GraphModule`` or an object with
``iter_graphs() -> {name: fx.Graph}`` (an ``IterGraphModule``) and editing it in place.

Environment: ``SPMD_SKIP_PASSES`` (comma-separated names), ``SPMD_DUMP_GRAPHS`` (a folder:
dump every graph before and after each pass), ``SPMD_PASS_TIMING=1`` (log timings at INFO
instead of DEBUG).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import torch
import torch.fx as fx

from spmd_backend.errors import SpmdGraphError, SpmdPassError
from spmd_backend.graph import ops
from spmd_backend.graph.meta import annotated
from spmd_backend.graph.utils import dump_graphs_to_files, emit_graph_artifact

log = logging.getLogger(__name__)

SKIP_ENV = "SPMD_SKIP_PASSES"
DUMP_ENV = "SPMD_DUMP_GRAPHS"
TIMING_ENV = "SPMD_PASS_TIMING"


@dataclass(frozen=True)
class PassSpec:
    """What a pass is and what it needs: the one declaration both faces use."""

    name: str
    fn: Callable[..., Any]
    prerequisites: tuple[str, ...] = ()
    apply_after: tuple[str, ...] = ()
    reorders_collectives: bool = False


#: every declared pass by name (later declarations of a name replace earlier ones)
_REGISTRY: dict[str, PassSpec] = {}

#: legacy face: names of passes applied so far (callers reset it with ``.clear()``)
_optimized_func: set[str] = set()


def _name_of(p: object) -> str:
    if isinstance(p, str):
        return p
    if isinstance(p, PassSpec):
        return p.name
    spec = getattr(p, "__spmd_pass__", None)
    if isinstance(spec, PassSpec):
        return spec.name
    name = getattr(p, "__name__", None)
    if name is None:
        raise SpmdPassError(f"cannot name pass {p!r}: expected a function, PassSpec or name")
    return name


def declare_pass(
    fn: Callable[..., Any],
    *,
    prerequisites: Iterable[object] = (),
    apply_after: Iterable[object] = (),
    reorders_collectives: bool = False,
    name: str | None = None,
) -> PassSpec:
    """Declare ``fn`` as a pass and register it by name.

    ``prerequisites``: passes that must have run before (and must be scheduled).
    ``apply_after``: passes that, when scheduled, must run before this one.
    ``reorders_collectives``: the pass may change the relative order of collectives.
    """
    spec = PassSpec(
        name=name or fn.__name__,
        fn=fn,
        prerequisites=tuple(_name_of(p) for p in prerequisites),
        apply_after=tuple(_name_of(p) for p in apply_after),
        reorders_collectives=reorders_collectives,
    )
    _REGISTRY[spec.name] = spec
    return spec


def pass_spec_of(p: object) -> PassSpec:
    """The :class:`PassSpec` of a spec, a declared/decorated function or a registered name."""
    if isinstance(p, PassSpec):
        return p
    spec = getattr(p, "__spmd_pass__", None)
    if isinstance(spec, PassSpec):
        return spec
    if isinstance(p, str) and p in _REGISTRY:
        return _REGISTRY[p]
    if callable(p):  # an undeclared function: no dependencies, and not registered
        return PassSpec(name=getattr(p, "__name__", repr(p)), fn=p)
    raise SpmdPassError(f"unknown pass {p!r}; declared passes: {sorted(_REGISTRY)}")


# --------------------------------------------------------------------------- graphs of a module
def graphs_of(gm: object) -> dict[str, fx.Graph]:
    """The graphs a pass edits: ``{"main": gm.graph}`` or an IterGraphModule's graphs."""
    iter_graphs = getattr(gm, "iter_graphs", None)
    if callable(iter_graphs):
        graphs = iter_graphs()
        if isinstance(graphs, Mapping):
            return dict(graphs)
    graph = getattr(gm, "graph", None)
    return {"main": graph} if isinstance(graph, fx.Graph) else {}


def _recompile(gm: object) -> None:
    recompile = getattr(gm, "recompile", None)
    if callable(recompile):
        recompile()


def cleanup_graph(graph: fx.Graph) -> None:
    """``lint`` + dead-code elimination that keeps mutations, collectives and outputs.

    (``eliminate_dead_code`` lints the graph before it starts.)
    """
    graph.eliminate_dead_code(is_impure_node=ops.has_side_effect)


# --------------------------------------------------------------------------- verification
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


def _has_val(node: fx.Node) -> bool:
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
            all_vals=all(_has_val(n) for n in graph.nodes),
            all_annotated=all(annotated(n) for n in graph.nodes),
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
    """Check the SPMD invariants; raise :class:`SpmdGraphError` naming the pass and node.

    * ``graph.lint()`` passes;
    * every collective is consumed by exactly one ``wait_tensor`` and nothing else;
    * collectives that existed ``before`` keep their relative order per process group, unless
      the pass declared ``reorders_collectives``;
    * (``require_vals``) every placeholder and call node that returns something has
      ``meta["val"]``;
    * (``require_annotations``) every node carries a phase annotation.

    The manager requires the last two only of graphs that satisfied them before the pass, so
    hand-built test graphs without fake values or annotations can still be verified.
    """
    where = f"after pass {pass_name!r}" if pass_name else "in graph"
    if lint:
        graph.lint()
    for node in graph.nodes:
        if ops.is_collective(node):
            waits = [u for u in node.users if ops.is_wait(u)]
            if len(waits) != 1 or len(node.users) != 1:
                raise SpmdGraphError(
                    f"{where}: collective {node.name} must be used by exactly one wait_tensor, "
                    f"found users {[u.name for u in node.users]}"
                )
        if require_vals and not _has_val(node):
            raise SpmdGraphError(f"{where}: node {node.name} has no meta['val']")
        if require_annotations and not annotated(node):
            raise SpmdGraphError(
                f"{where}: node {node.name} has no phase annotation (spmd_backend.graph.meta)"
            )
    if before is not None and not may_reorder:
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
                    f"(first moved: {first.name}); declare reorders_collectives=True if "
                    "intended"
                )


# --------------------------------------------------------------------------- instrumentation
@dataclass
class PassRecord:
    """What running one pass did."""

    name: str
    seconds: float = 0.0
    nodes_before: int = 0
    nodes_after: int = 0
    skipped: str = ""


def _node_count(gm: object) -> int:
    return sum(len(g.nodes) for g in graphs_of(gm).values())


def _dump(gm: object, folder: str, tag: str) -> None:
    graphs = graphs_of(gm)
    if graphs:
        dump_graphs_to_files({f"{tag}.{k}": g for k, g in graphs.items()}, folder)


def _run_one(
    spec: PassSpec,
    gm: object,
    args: tuple,
    kwargs: dict,
    *,
    verify: bool,
    dump_dir: str | None,
    index: int,
) -> tuple[Any, PassRecord]:
    graphs = graphs_of(gm)
    before = {k: GraphFacts.of(g) for k, g in graphs.items()} if verify else {}
    record = PassRecord(spec.name, nodes_before=_node_count(gm))
    if dump_dir:
        _dump(gm, dump_dir, f"{index:02d}.{spec.name}.before")
    t0 = time.perf_counter()
    result = spec.fn(gm, *args, **kwargs)
    for name, graph in graphs_of(gm).items():
        cleanup_graph(graph)
        facts = before.get(name)
        if verify and facts is not None:
            verify_graph(
                graph,
                pass_name=spec.name,
                before=facts.collectives,
                may_reorder=spec.reorders_collectives,
                require_vals=facts.all_vals,
                require_annotations=facts.all_annotated,
                lint=False,  # cleanup_graph just linted it
            )
    _recompile(gm)
    record.seconds = time.perf_counter() - t0
    record.nodes_after = _node_count(gm)
    level = logging.INFO if os.environ.get(TIMING_ENV) else logging.DEBUG
    log.log(
        level, "pass %s: %.3fs, %d -> %d nodes",
        spec.name, record.seconds, record.nodes_before, record.nodes_after,
    )
    if dump_dir:
        _dump(gm, dump_dir, f"{index:02d}.{spec.name}.after")
    for name, graph in graphs_of(gm).items():
        emit_graph_artifact(f"spmd_after_{spec.name}_{name}", graph)
    return result, record


# --------------------------------------------------------------------------- modern face
def _env_skips() -> set[str]:
    return {s.strip() for s in os.environ.get(SKIP_ENV, "").split(",") if s.strip()}


@dataclass
class PassManager:
    """Order, run, verify, time and dump a set of passes; see the module docstring.

    ``passes`` items are a pass (declared function, :class:`PassSpec` or registered name) or a
    ``(pass, {kwargs})`` pair. ``skip`` names passes not to run (added to ``SPMD_SKIP_PASSES``).
    ``dump_dir`` (or ``SPMD_DUMP_GRAPHS``) dumps graphs before/after each pass.
    """

    passes: Sequence[object]
    skip: Iterable[str] = ()
    dump_dir: str | None = None
    verify: bool = True
    records: list[PassRecord] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self._items: list[tuple[PassSpec, dict[str, Any]]] = []
        for item in self.passes:
            if isinstance(item, tuple):
                p, kw = item
                self._items.append((pass_spec_of(p), dict(kw)))
            else:
                self._items.append((pass_spec_of(item), {}))
        names = [s.name for s, _ in self._items]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise SpmdPassError(f"PassManager: passes scheduled more than once: {dupes}")
        self._order = self._sort()

    def _sort(self) -> list[tuple[PassSpec, dict[str, Any]]]:
        by_name = {s.name: (s, kw) for s, kw in self._items}
        position = {s.name: i for i, (s, _) in enumerate(self._items)}
        dag: nx.DiGraph = nx.DiGraph()
        dag.add_nodes_from(by_name)
        for spec, _ in self._items:
            missing = [p for p in spec.prerequisites if p not in by_name]
            if missing:
                raise SpmdPassError(
                    f"PassManager: {missing} are the prerequisites of {spec.name} but are not "
                    f"scheduled (scheduled: {list(by_name)})"
                )
            for p in spec.prerequisites:
                dag.add_edge(p, spec.name)
            for p in spec.apply_after:
                if p in by_name:
                    dag.add_edge(p, spec.name)
        try:
            order = list(nx.lexicographical_topological_sort(dag, key=position.__getitem__))
        except nx.NetworkXUnfeasible:
            cycle = nx.find_cycle(dag)
            names = " -> ".join([a for a, _ in cycle] + [cycle[0][0]])
            raise SpmdPassError(f"PassManager: pass dependencies form a cycle: {names}") from None
        return [by_name[n] for n in order]

    @property
    def order(self) -> list[str]:
        """Pass names in the order they will run."""
        return [s.name for s, _ in self._order]

    def run(self, gm: object) -> list[PassRecord]:
        """Run the passes on ``gm`` (edited in place); returns what each did."""
        skip = set(self.skip) | _env_skips()
        dump_dir = self.dump_dir or os.environ.get(DUMP_ENV) or None
        skipped: set[str] = set()
        records: list[PassRecord] = []
        for i, (spec, kwargs) in enumerate(self._order):
            blocked = [p for p in spec.prerequisites if p in skipped]
            if spec.name in skip or blocked:
                why = "skipped by name" if spec.name in skip else f"prerequisite {blocked} skipped"
                log.info("pass %s %s", spec.name, why)
                skipped.add(spec.name)
                records.append(PassRecord(spec.name, skipped=why))
                continue
            _, record = _run_one(
                spec, gm, (), kwargs, verify=self.verify, dump_dir=dump_dir, index=i
            )
            records.append(record)
        self.records = records
        return records

    __call__ = run


# --------------------------------------------------------------------------- legacy face
def graph_optimization_pass(
    prerequisites: Iterable[Callable[..., Any]], apply_after: Iterable[Callable[..., Any]]
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The seed's decorator: declare a pass and check its order against ``_optimized_func``.

    Calling the decorated pass fails with ``AssertionError`` when it already ran ("Cannot apply
    ... twice"), when a pass that must follow it already ran ("... must be applied after ..."),
    or when a prerequisite has not run ("... are the prerequisites of ..."). After the pass
    the post-pass work runs and its name is added to ``_optimized_func``.
    """
    prerequisites = list(prerequisites)
    apply_after = list(apply_after)

    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        spec = declare_pass(fn, prerequisites=prerequisites, apply_after=apply_after)

        @functools.wraps(fn)
        def wrapper(gm: object, *args: Any, **kwargs: Any) -> Any:
            name = spec.name
            if name in _optimized_func:
                raise AssertionError(f"Cannot apply {name} twice.")
            must_follow = sorted(
                other for other in _optimized_func
                if other in _REGISTRY and name in _REGISTRY[other].apply_after
            )
            if must_follow:
                raise AssertionError(f"{must_follow} must be applied after {name}.")
            missing = sorted(set(spec.prerequisites) - _optimized_func)
            if missing:
                raise AssertionError(
                    f"{missing} are the prerequisites of {name} but are not applied."
                )
            result, _ = _run_one(
                spec, gm, args, kwargs, verify=True,
                dump_dir=os.environ.get(DUMP_ENV) or None, index=len(_optimized_func),
            )
            _optimized_func.add(name)
            return result

        wrapper.__spmd_pass__ = spec  # type: ignore[attr-defined]
        return wrapper

    return decorator
