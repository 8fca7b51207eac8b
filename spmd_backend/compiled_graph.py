"""One cached graph of ``spmd_backend.compile``: what it was traced from and how it runs.

Requires: a traced, expanded step (:class:`~spmd_backend.tracing.trace.TracedStep`) and what the
compile door made of it. Guarantees: :class:`CompiledGraph` holds everything a call needs to
reuse the graph (its guards, the runner, the rollback plan, the consistency digest, the mode
switches the step itself made) and nothing mutable but the hyper-parameter cache;
:func:`accepts_last_iter` says whether a runner takes ``last_iter`` (an ``IterGraphModule``).
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx
import torch.nn as nn

from spmd_backend.parallel.data_parallel import ExpansionReport
from spmd_backend.runtime import RollbackPlan
from spmd_backend.tracing.binding import StepBinding
from spmd_backend.tracing.key import Guard, StepKey
from spmd_backend.tracing.layout import StepLayout
from spmd_backend.tracing.shapes import ShapeGuard
from spmd_backend.tracing.trace import TracedStep


def accepts_last_iter(runner: Callable[..., Any]) -> bool:
    if isinstance(runner, fx.GraphModule):  # its forward takes exactly its placeholders
        return any(n.op == "placeholder" and n.target == "last_iter" for n in runner.graph.nodes)
    target = getattr(runner, "forward", runner)
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return False
    return any(
        p.name == "last_iter" or p.kind is inspect.Parameter.VAR_KEYWORD
        for p in sig.parameters.values()
    )


@dataclass
class CompiledGraph:
    """One traced, expanded and (unless bootstrap) transformed graph, ready to run."""

    key: StepKey
    traced: TracedStep
    runner: Callable[..., Any]
    bootstrap: bool
    takes_last_iter: bool
    expansion: ExpansionReport
    compile_seconds: float
    rollback: RollbackPlan = RollbackPlan((), (), "")
    hyper_cache: dict = field(default_factory=dict)
    #: (module, training) the step's own ``model.train()``/``eval()`` set while tracing; the
    #: graph's replays do not run Python, so each successful run sets them again
    mode_effects: tuple[tuple[nn.Module, bool], ...] = ()
    #: digest of what ranks must agree on (state inputs, collective schedule); "" unchecked
    schedule: str = ""
    #: why it was traced ("first call", "argument 'which' changed from 1 to 2", ...)
    reason: str = ""
    #: weak references to the module and optimizer it was traced for (the cache drops a graph
    #: whose objects are gone when it would otherwise refuse a new one: a new model per fold)
    owners: tuple[weakref.ref, ...] = ()

    @property
    def orphaned(self) -> bool:
        """Whether the module or optimizer it was traced for no longer exists."""
        return any(ref() is None for ref in self.owners)

    @property
    def layout(self) -> StepLayout:
        return self.traced.layout

    def failed_guard(self, binding: StepBinding) -> Guard | ShapeGuard | None:
        """The first guard that keeps this graph (whose key matched) from ``binding``'s call."""
        for guard in self.traced.guards:
            if not guard.holds(binding):
                return guard
        shape_guard = self.traced.shape_guard
        if shape_guard is not None and not shape_guard.holds(binding):
            return shape_guard
        return None


__all__ = ["CompiledGraph", "accepts_last_iter"]
