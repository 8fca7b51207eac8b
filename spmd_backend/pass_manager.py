"""Pass declaration, ordering, verification and instrumentation.

A pass is a plain function ``fn(gm, **kwargs)`` taking a ``GraphModule`` or an object with
``iter_graphs() -> {name: fx.Graph}`` (an ``IterGraphModule``) and editing it in place. Calling
it directly does the edit and nothing else; it keeps no state between calls.

:func:`declare_pass` records, once per pass, what the manager needs to know (:class:`PassSpec`):
the passes that must run before it (``prerequisites``), the passes it must follow when both are
scheduled (``apply_after``), both by name so that passes need not import each other, and
whether it may reorder collectives. The record is a table of declarations keyed by name
(:func:`pass_spec_of` finds a declared function, a spec or a name); it holds no run state.

:class:`PassManager` takes passes in any order, sorts them by their declared dependencies
(networkx topological sort, stable in the given order), refuses missing prerequisites and cycles
naming the passes involved, and runs each pass followed by the post-pass work
(:func:`run_pass`): ``graph.lint()``, dead-code elimination that keeps side effects, verification
of the SPMD invariants (:func:`spmd_backend.graph.invariants.verify_graph`), recompile, a timing
log line and optional graph dumps. Passes can be skipped by name (``skip=`` or
``SPMD_SKIP_PASSES=a,b``); a pass whose prerequisite is skipped is skipped too. A manager owns
no global state: two managers, or one manager on two graphs, never interfere.

The upstream seed's order-checking decorator ``graph_optimization_pass`` and its process-wide
record ``_optimized_func`` are a compatibility face in :mod:`spmd_backend.graph_optimization`.

Environment: ``SPMD_SKIP_PASSES`` (comma-separated names), ``SPMD_DUMP_GRAPHS`` (a folder:
dump every graph before and after each pass), ``SPMD_PASS_TIMING=1`` (log timings at INFO
instead of DEBUG).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import torch.fx as fx

from spmd_backend.errors import SpmdPassError
from spmd_backend.graph import ops
from spmd_backend.graph.invariants import GraphFacts, verify_graph
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


def _declared(p: object) -> PassSpec | None:
    """The spec declared for function ``p`` (or for a function it wraps), if any."""
    fn: object = p
    for _ in range(8):  # follow functools.wraps chains (the seed-compatible wrappers)
        for spec in _REGISTRY.values():
            if spec.fn is fn:
                return spec
        fn = getattr(fn, "__wrapped__", None)
        if fn is None:
            return None
    return None


def _name_of(p: object) -> str:
    if isinstance(p, str):
        return p
    if isinstance(p, PassSpec):
        return p.name
    spec = _declared(p)
    if spec is not None:
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
    """Declare ``fn`` as a pass and register it by name; ``fn`` itself is left untouched.

    ``prerequisites``: passes that must have run before (and must be scheduled).
    ``apply_after``: passes that, when scheduled, must run before this one.
    Both are best given by name (a string): a pass need not import another to depend on it.
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
    """The :class:`PassSpec` of a spec, a declared function (or a wrapper of one) or a name.

    An undeclared function gets a spec without dependencies, which is not registered.
    """
    if isinstance(p, PassSpec):
        return p
    if isinstance(p, str):
        if p in _REGISTRY:
            return _REGISTRY[p]
        raise SpmdPassError(f"unknown pass {p!r}; declared passes: {sorted(_REGISTRY)}")
    if callable(p):
        return _declared(p) or PassSpec(name=getattr(p, "__name__", repr(p)), fn=p)
    raise SpmdPassError(f"unknown pass {p!r}: expected a function, PassSpec or name")


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


def run_pass(
    spec: PassSpec,
    gm: object,
    args: tuple = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    verify: bool = True,
    dump_dir: str | None = None,
    index: int = 0,
) -> tuple[Any, PassRecord]:
    """Run one pass and its post-pass work (see the module docstring); returns the pass's
    result and what it did. ``index`` numbers the dump files."""
    graphs = graphs_of(gm)
    before = {k: GraphFacts.of(g) for k, g in graphs.items()} if verify else {}
    record = PassRecord(spec.name, nodes_before=_node_count(gm))
    if dump_dir:
        _dump(gm, dump_dir, f"{index:02d}.{spec.name}.before")
    t0 = time.perf_counter()
    result = spec.fn(gm, *args, **(kwargs or {}))
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


# --------------------------------------------------------------------------- the manager
def env_skips() -> set[str]:
    """The pass names ``SPMD_SKIP_PASSES`` skips in every manager."""
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
        skip = set(self.skip) | env_skips()
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
            _, record = run_pass(
                spec, gm, (), kwargs, verify=self.verify, dump_dir=dump_dir, index=i
            )
            records.append(record)
        self.records = records
        return records

    __call__ = run
