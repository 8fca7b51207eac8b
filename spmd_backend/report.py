"""A readable report of a traced step, grouped by module and phase.

:func:`step_report` walks a step graph (any graph annotated by the tracer: the raw trace, a
transformed graph, an IterGraphModule's graph) and returns a :class:`StepReport` with one row per
(module FQN, phase): number of ops, bytes communicated by collectives, and a FLOP estimate from
torch's FLOP formulas (``torch.utils.flop_counter``) evaluated on the nodes' fake shapes.
``str(report)`` is a text table; ``report.by_phase()`` and ``report.rows`` serve programs.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx
import torch.utils._pytree as pytree

from spmd_backend.graph import ops
from spmd_backend.graph.meta import Phase, get_fqn, get_phase
from spmd_backend.graph.utils import tensor_nbytes


@dataclass
class ReportRow:
    """Totals of one (module, phase) group."""

    fqn: str | None
    phase: str
    ops: int = 0
    comm_bytes: int = 0
    flops: int = 0

    def add(self, other: ReportRow) -> None:
        self.ops += other.ops
        self.comm_bytes += other.comm_bytes
        self.flops += other.flops


@dataclass
class StepReport:
    """Per-module, per-phase totals of a step graph (see the module docstring)."""

    rows: list[ReportRow] = field(default_factory=list)

    def by_phase(self) -> dict[str, ReportRow]:
        out: dict[str, ReportRow] = {}
        for r in self.rows:
            out.setdefault(r.phase, ReportRow(None, r.phase)).add(r)
        return out

    def total(self) -> ReportRow:
        t = ReportRow(None, "total")
        for r in self.rows:
            t.add(r)
        return t

    def __str__(self) -> str:
        header = f"{'module':<36} {'phase':<10} {'ops':>6} {'comm MB':>9} {'GFLOP':>9}"
        lines = [header, "-" * len(header)]
        for r in self.rows:
            name = "(none)" if r.fqn is None else (r.fqn or "(root)")
            lines.append(
                f"{name:<36} {r.phase:<10} {r.ops:>6} {r.comm_bytes / 2**20:>9.2f} {r.flops / 1e9:>9.3f}"
            )
        lines.append("-" * len(header))
        for phase, r in sorted(self.by_phase().items()):
            lines.append(
                f"{'all modules':<36} {phase:<10} {r.ops:>6} {r.comm_bytes / 2**20:>9.2f} {r.flops / 1e9:>9.3f}"
            )
        t = self.total()
        lines.append(
            f"{'total':<36} {'':<10} {t.ops:>6} {t.comm_bytes / 2**20:>9.2f} {t.flops / 1e9:>9.3f}"
        )
        return "\n".join(lines)


def _flops(node: fx.Node) -> int:
    from torch.utils.flop_counter import flop_registry

    target = node.target
    packet = getattr(target, "_overloadpacket", None)
    formula = flop_registry.get(packet) if packet is not None else None
    if formula is None:
        return 0

    def val(a: Any) -> Any:
        return a.meta.get("val") if isinstance(a, fx.Node) else a

    try:
        args, kwargs = pytree.tree_map(val, (node.args, node.kwargs))
        return int(formula(*args, out_val=node.meta.get("val"), **kwargs))
    except Exception:  # noqa: BLE001 - an estimate: unknown shapes count as zero
        return 0


def step_report(gm: Any) -> StepReport:
    """The :class:`StepReport` of ``gm`` (a GraphModule or anything with ``.graph``)."""
    graph: fx.Graph = gm.graph if not isinstance(gm, fx.Graph) else gm
    groups: dict[tuple[str | None, str], ReportRow] = {}
    order: dict[tuple[str | None, str], int] = defaultdict(lambda: len(order))
    for node in graph.nodes:
        if node.op != "call_function" or ops.is_getitem(node):
            continue
        phase = get_phase(node)
        key = (get_fqn(node), str(phase) if phase is not None else "?")
        order[key]
        row = groups.setdefault(key, ReportRow(key[0], key[1]))
        row.ops += 1
        if ops.is_collective(node) and isinstance(node.args[0], fx.Node):
            row.comm_bytes += tensor_nbytes(node.args[0].meta.get("val"))
        row.flops += _flops(node)
    phases = [p.value for p in Phase]
    rows = sorted(
        groups.values(),
        key=lambda r: (phases.index(r.phase) if r.phase in phases else 99, order[(r.fqn, r.phase)]),
    )
    return StepReport(rows=rows)
