"""Running a compiled step so that a failure changes nothing, and says where it failed.

:func:`rollback_plan` decides, once per compiled graph, which graph inputs a failure could leave
half-written (:func:`spmd_backend.graph.commit.inputs_at_risk` on the fx graphs it runs, or the
lowered module's source graph; every written input for a callable it cannot see into). :func:`run_step` snapshots exactly those before each call, restores them when the call
raises, and re-raises as :class:`~spmd_backend.errors.SpmdRuntimeError` (or
:class:`~spmd_backend.errors.SpmdDistributedError` for a failed collective) naming the node
that failed: the fx node of an fx graph (from the generated code's line map), the source nodes
Inductor lists above the failing kernel call. For the default pipeline the plan holds only the
optimizer's step counters (incremented before the gradients arrive): parameters and moments are
written by ops that depend on every collective. Small snapshots (the step counters) are copied
into buffers the plan keeps, one multi-tensor copy per call (:data:`KEEP_BUFFERS_BYTES`).
"""

from __future__ import annotations

import linecache
import logging
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from spmd_backend.errors import SpmdDistributedError, SpmdError, SpmdRuntimeError
from spmd_backend.graph import ops
from spmd_backend.graph.commit import CommitRisk, inputs_at_risk, union
from spmd_backend.graph.meta import bucket_params
from spmd_backend.graph.utils import mutated_placeholders

log = logging.getLogger(__name__)

_COMM_MARKERS = ("timed out", "timeout", "connection", "peer", "gloo", "nccl")


#: snapshots up to this size are copied into buffers the plan keeps between calls (one
#: multi-tensor copy per call instead of a clone per tensor: on a GPU, one launch instead of one
#: per optimizer step counter); larger ones are cloned per call, so their memory is not held
#: between steps
KEEP_BUFFERS_BYTES = 1 << 20


@dataclass(frozen=True)
class RollbackPlan:
    """Flat input positions to snapshot before a call (empty: nothing can be half-written)."""

    positions: tuple[int, ...]
    names: tuple[str, ...]
    reason: str
    #: the kept snapshot buffers (see KEEP_BUFFERS_BYTES), made on the first snapshot
    _buffers: list[torch.Tensor] = field(default_factory=list, compare=False, repr=False)

    def snapshot(self, flat: Sequence[Any]) -> list[torch.Tensor]:
        src = [flat[i].detach() for i in self.positions]
        if not src:
            return []
        bufs = self._buffers
        if not bufs or any(
            b.shape != t.shape or b.dtype != t.dtype or b.device != t.device
            for b, t in zip(bufs, src)
        ):
            if sum(t.numel() * t.element_size() for t in src) > KEEP_BUFFERS_BYTES:
                return [t.clone() for t in src]
            bufs[:] = [torch.empty_like(t) for t in src]
        torch._foreach_copy_(bufs, src)
        return bufs

    def restore(self, flat: Sequence[Any], saved: list[torch.Tensor]) -> None:
        with torch.no_grad():
            torch._foreach_copy_([flat[i] for i in self.positions], saved)


def _graphs(runner: Any) -> list[fx.Graph] | None:
    """The fx graphs ``runner`` executes (None: it is opaque)."""
    source_graphs = getattr(runner, "source_graphs", None)  # an IterGraphModule
    if callable(source_graphs):
        return list(source_graphs().values())
    graph = getattr(runner, "graph", None)  # a GraphModule, or a lowered module's source graph
    return [graph] if isinstance(graph, fx.Graph) else None


def rollback_plan(runner: Any, source: fx.Graph, n_inputs: int) -> RollbackPlan:
    """Which of the ``n_inputs`` step inputs to snapshot for ``runner`` (see module docstring)."""
    found = _graphs(runner)
    if found is None:  # an opaque callable: everything the step writes is at risk
        placeholders = [n for n in source.nodes if n.op == "placeholder"]
        written = {p for n in source.nodes for p in mutated_placeholders(n)}
        pos = tuple(i for i, p in enumerate(placeholders) if p in written)
        return RollbackPlan(pos, tuple(placeholders[i].name for i in pos),
                            f"the transformation returned an opaque {type(runner).__name__}")
    risk: CommitRisk = union(inputs_at_risk(g) for g in found)
    keep = [(p, n) for p, n in zip(risk.positions, risk.names) if p < n_inputs]
    return RollbackPlan(
        tuple(p for p, _ in keep), tuple(n for _, n in keep),
        f"written before {risk.fallible_after}, which can still fail" if keep else "",
    )


def log_plan(plan: RollbackPlan, name: str, inputs: Sequence[Any]) -> None:
    """Say once what each call of step ``name`` snapshots (WARNING from 1 MB on)."""
    if not plan.positions:
        return
    mb = sum(inputs[i].numel() * inputs[i].element_size() for i in plan.positions) / 2**20
    log.log(
        logging.WARNING if mb >= 1.0 else logging.INFO,
        "spmd_backend: %s writes %d input(s) (%s, %.2f MB) %s; each call snapshots them so "
        "that a failure can restore them", name, len(plan.positions),
        ", ".join(plan.names[:4]) + (" ..." if len(plan.names) > 4 else ""), mb, plan.reason,
    )


def describe_collectives(graph: fx.Graph) -> str:
    """The collectives of ``graph``, each with the parameters it carries (for error messages)."""
    rows = [
        f"{n.name} ({', '.join(bucket_params(n)) or 'buffers'})"
        for n in graph.nodes if ops.is_collective(n)
    ]
    return "; ".join(rows) or "none"


class GuardedStep:
    """A compiled step called with a flat input list (AOTAutograd's boxed convention, hence
    ``_boxed_call``) through :func:`run_step`: the rollback plan is made on the first call (from
    the inputs' sizes, logged as the compile door logs it), and a failure restores the inputs at
    risk and names the failing node. ``name`` says which step, in the log."""

    _boxed_call = True

    def __init__(self, runner: Any, name: str) -> None:
        self.runner = runner
        self.name = name
        self._plan: RollbackPlan | None = None

    def _source(self) -> fx.Graph:
        found = _graphs(self.runner)
        if not found:
            raise SpmdRuntimeError(f"spmd_backend: {self.name}: the compiled step has no graph")
        return found[0]

    def plan(self, inputs: Sequence[Any]) -> RollbackPlan:
        if self._plan is None:
            self._plan = rollback_plan(self.runner, self._source(), len(inputs))
            log_plan(self._plan, self.name, inputs)
        return self._plan

    def __call__(self, inputs: list[Any]) -> Any:
        return run_step(self.runner, inputs, {}, self.plan(inputs),
                        lambda: describe_collectives(self._source()))


def _fx_node(frame: traceback.FrameSummary, graph_modules: list[fx.GraphModule]) -> str | None:
    for gm in graph_modules:
        code = getattr(type(gm).forward, "__code__", None)
        if code is None or code.co_filename != frame.filename:
            continue
        lineno_map = getattr(gm, "_lineno_map", None) or {}
        index = lineno_map.get(frame.lineno - getattr(gm, "_prologue_start", 0))
        if index is None:
            continue
        nodes = list(gm.graph.nodes)
        if 0 <= index < len(nodes):
            return nodes[index].format_node() or nodes[index].name
    return None


_INDUCTOR_COMMENT = "Topologically Sorted Source Nodes:"


def _inductor_nodes(frame: traceback.FrameSummary) -> str | None:
    """The source-node comment Inductor writes above a kernel call in its wrapper code."""
    for lineno in range(frame.lineno, max(frame.lineno - 30, 0), -1):
        line = linecache.getline(frame.filename, lineno)
        if _INDUCTOR_COMMENT in line:
            return line.split(_INDUCTOR_COMMENT, 1)[1].split(", Original ATen")[0].strip()
    return None


def _graph_modules(runner: Any) -> list[fx.GraphModule]:
    found = [runner] if isinstance(runner, fx.GraphModule) else []
    for kind in ("setup", "main", "cleanup", "plain", "flush"):
        cached = getattr(runner, "_modules_by_kind", {}).get(kind)
        if isinstance(cached, fx.GraphModule):
            found.append(cached)
    return found


def failure_site(exc: BaseException, runner: Any) -> str:
    """The node (or Inductor source nodes) whose execution raised ``exc``, described."""
    frames = traceback.extract_tb(exc.__traceback__)
    modules = _graph_modules(runner)
    for frame in reversed(frames):
        node = _fx_node(frame, modules)
        if node:
            return f"node {node}"
        nodes = _inductor_nodes(frame) if frame.filename.endswith(".py") else None
        if nodes:
            return f"the Inductor kernel for nodes {nodes}"
    return "an unidentified node (run without Inductor to name it)"


def run_step(
    runner: Callable[..., Any], flat: list[Any], kwargs: dict[str, Any], plan: RollbackPlan,
    collectives: Callable[[], str],
) -> Any:
    """Call ``runner(*flat, **kwargs)``; on failure restore ``plan``'s inputs and raise an
    :class:`SpmdError` that names the failing node (see the module docstring)."""
    saved = plan.snapshot(flat) if plan.positions else None
    try:
        with torch.no_grad():
            return runner(*flat, **kwargs)
    except Exception as e:  # noqa: BLE001 - re-raised as an SpmdError, state restored
        if saved is not None:
            plan.restore(flat, saved)
        if isinstance(e, SpmdError):
            raise
        text = str(e)
        first = text.splitlines()[0] if text else type(e).__name__
        site = failure_site(e, runner)
        restored = (
            f"restored {len(plan.positions)} input(s) written before the failure"
            if saved is not None else "no input had been written"
        )
        if any(m in text.lower() for m in _COMM_MARKERS):
            raise SpmdDistributedError(
                "spmd_backend: a collective of the compiled step failed or timed out (another "
                f"rank failed or is stuck?) at {site}; the graph's collectives: {collectives()}; "
                f"{restored}. Cause: {first}"
            ) from e
        raise SpmdRuntimeError(
            f"spmd_backend: the compiled step failed at {site}: {type(e).__name__}: {first}; "
            f"{restored}, so parameters, buffers, gradients and optimizer state are as before "
            "the call"
        ) from e
