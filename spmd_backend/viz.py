"""Pictures and tables of a step: timeline PNG, graph SVG, per-bucket table.

* :func:`profile_step` runs one call under ``torch.profiler`` and returns a :class:`Timeline`:
  top-level op intervals of the calling thread (compute) and the in-flight interval of every
  collective (from issue to the end of its wait; issues and waits are paired in order, which
  matches graphs whose waits keep the collectives' order, as the passes do);
* :func:`timeline_png` draws one or more timelines (for example before and after the passes) as
  lanes of compute and in-flight collectives (matplotlib, ``pip install spmd_backend[viz]``);
* :func:`graph_svg` draws a step graph: one row per module FQN, one column per node in graph
  order, coloured by phase, with edges between consecutive uses (plain SVG, no dependencies);
* :func:`bucket_table` lists the collectives: parameters, bytes, where each is issued and
  waited in the graph (and, given a timeline, when).
"""

from __future__ import annotations

import html
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from spmd_backend.graph import ops
from spmd_backend.graph.meta import Phase, bucket_params, get_fqn, get_phase
from spmd_backend.graph.utils import node_order, tensor_nbytes

PHASE_COLOURS = {
    Phase.INPUT: "#bdbdbd",
    Phase.FORWARD: "#4e79a7",
    Phase.BACKWARD: "#f28e2b",
    Phase.RECOMPUTE: "#edc948",
    Phase.OPTIMIZER: "#59a14f",
    Phase.COMM: "#e15759",
    Phase.OUTPUT: "#7f7f7f",
}


@dataclass
class Timeline:
    """Intervals (seconds from the step start) of compute ops and in-flight collectives."""

    label: str
    total_s: float
    compute: list[tuple[float, float, str]] = field(default_factory=list)
    collectives: list[tuple[float, float, str]] = field(default_factory=list)

    @property
    def exposed_wait_s(self) -> float:
        return sum(e - s for s, e, name in self.compute if "wait_tensor" in name)


def profile_step(run: Callable[[], Any], label: str) -> Timeline:
    """Run ``run()`` once under the profiler; see the module docstring."""
    from torch.profiler import profile

    with profile() as prof:
        run()
    events = [e for e in prof.events() if e.time_range.end > e.time_range.start]
    if not events:
        return Timeline(label, 0.0)
    t0 = min(e.time_range.start for e in events)
    main_thread = max({e.thread for e in events}, key=lambda t: sum(1 for e in events if e.thread == t))
    top: list[tuple[float, float, str]] = []
    last_end = -1.0
    for e in sorted((e for e in events if e.thread == main_thread), key=lambda e: e.time_range.start):
        s, end = (e.time_range.start - t0) / 1e6, (e.time_range.end - t0) / 1e6
        if s >= last_end and not e.name.startswith(("ProfilerStep", "## Call", "AOTDispatcher")):
            top.append((s, end, e.name))
            last_end = end
    issues = [x for x in top if "all_reduce" in x[2] or "broadcast" in x[2]]
    waits = [x for x in top if "wait_tensor" in x[2]]
    collectives = [(i[0], w[1], i[2]) for i, w in zip(issues, waits)]
    total = max(e for _, e, _ in top) if top else 0.0
    return Timeline(label, total, top, collectives)


def timeline_png(timelines: Sequence[Timeline], path: str) -> str:
    """Draw ``timelines`` (one panel each) into a PNG at ``path``; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(timelines), 1, figsize=(12, 1.8 * len(timelines) + 0.6), squeeze=False)
    for ax, tl in zip(axes[:, 0], timelines):
        for s, e, name in tl.compute:
            colour = "#e15759" if "wait_tensor" in name else ("#59a14f" if "fused" in name or "foreach" in name else "#4e79a7")
            ax.broken_barh([(s * 1e3, (e - s) * 1e3)], (10, 8), facecolors=colour)
        for i, (s, e, _name) in enumerate(tl.collectives):
            ax.broken_barh([(s * 1e3, (e - s) * 1e3)], (0 + (i % 3) * 3, 2.5), facecolors="#f28e2b")
        ax.set_yticks([5, 14])
        ax.set_yticklabels(["collectives\nin flight", "compute\n(red: waiting)"])
        waiting = (
            f"waiting {tl.exposed_wait_s * 1e3:.1f} ms" if tl.collectives
            else "collectives not visible as graph ops (e.g. DDP's reducer): not drawn"
        )
        ax.set_title(f"{tl.label}: {tl.total_s * 1e3:.1f} ms, {waiting}", fontsize=10, loc="left")
        ax.set_xlim(0, max(t.total_s for t in timelines) * 1e3 * 1.02 or 1)
    axes[-1, 0].set_xlabel("ms since the step started")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def graph_svg(gm: Any, path: str, *, max_nodes: int = 4000) -> str:
    """Draw the step graph of ``gm`` as SVG at ``path`` (rows: module FQN, colour: phase)."""
    graph: fx.Graph = gm if isinstance(gm, fx.Graph) else gm.graph
    nodes = [n for n in graph.nodes][:max_nodes]
    rows: dict[str, int] = {}
    for n in nodes:
        rows.setdefault(get_fqn(n) if get_fqn(n) is not None else "(none)", len(rows))
    cell, left, top = 6, 220, 30
    width = left + cell * len(nodes) + 20
    height = top + 14 * len(rows) + 40
    pos = {n: (left + i * cell, top + 14 * rows[get_fqn(n) if get_fqn(n) is not None else "(none)"]) for i, n in enumerate(nodes)}
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="monospace" font-size="10">']
    for name, r in rows.items():
        out.append(f'<text x="4" y="{top + 14 * r + 9}">{html.escape(name or "(root)")}</text>')
    for n in nodes:
        x, y = pos[n]
        for user in n.users:
            if user in pos:
                ux, uy = pos[user]
                out.append(f'<line x1="{x + 2}" y1="{y + 5}" x2="{ux + 2}" y2="{uy + 5}" stroke="#ccc" stroke-width="0.3"/>')
    for n in nodes:
        x, y = pos[n]
        colour = PHASE_COLOURS.get(get_phase(n), "#000000")
        title = html.escape(f"{n.name}: {n.target} [{get_phase(n)}]")
        out.append(f'<rect x="{x}" y="{y}" width="{cell - 1}" height="10" fill="{colour}"><title>{title}</title></rect>')
    legend_y = top + 14 * len(rows) + 20
    for i, (phase, colour) in enumerate(PHASE_COLOURS.items()):
        out.append(f'<rect x="{left + i * 90}" y="{legend_y}" width="10" height="10" fill="{colour}"/>')
        out.append(f'<text x="{left + i * 90 + 14}" y="{legend_y + 9}">{phase}</text>')
    out.append("</svg>")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(out))
    return path


def bucket_table(gm: Any, timeline: Timeline | None = None) -> str:
    """A markdown table of the graph's collectives (see the module docstring)."""
    graph: fx.Graph = gm if isinstance(gm, fx.Graph) else gm.graph
    order = node_order(graph)
    compute_before = [n for n in graph.nodes if n.op == "call_function" and get_phase(n) in (Phase.FORWARD, Phase.BACKWARD, Phase.RECOMPUTE)]
    rows = ["| collective | parameters | MB | issued after | waited before | in flight ms |", "|---|---|---|---|---|---|"]
    flights = list(timeline.collectives) if timeline else []
    for i, node in enumerate(n for n in graph.nodes if ops.is_collective(n)):
        payload = node.args[0] if isinstance(node.args[0], fx.Node) else None
        mb = tensor_nbytes(payload.meta.get("val")) / 2**20 if payload is not None else 0.0
        before = [c for c in compute_before if order[c] < order[node]]
        wait = next((u for u in node.users if ops.is_wait(u)), None)
        consumer = None
        if wait is not None:
            later = [n for n in graph.nodes if order[n] > order[wait] and get_phase(n) is not Phase.COMM]
            consumer = later[0] if later else None
        params = bucket_params(node) or ["(buffers)"]
        shown = ", ".join(params[:4]) + (f" +{len(params) - 4}" if len(params) > 4 else "")
        flight = f"{(flights[i][1] - flights[i][0]) * 1e3:.1f}" if i < len(flights) else "-"
        rows.append(
            f"| {node.name} | {shown} | {mb:.2f} | {before[-1].name if before else '(start)'} "
            f"({len(before)}/{len(compute_before)} compute ops) | {consumer.name if consumer else '(end)'} | {flight} |"
        )
    return "\n".join(rows)
