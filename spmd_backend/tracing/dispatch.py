"""The tracer's dispatch mode: rewrites ops that cannot be functionalized and annotates nodes.

:class:`TraceMode` sits on top of the mode stack during a full-step trace (above
``FunctionalTensorMode`` and make_fx's proxy mode). For every aten op the step runs it

* rewrites in-place fused optimizer kernels into their functional form plus ``copy_``
  (:mod:`spmd_backend.tracing.fused_optim`), and
* stamps every fx node created while that op was dispatched with the phase and owning-module
  FQN reported by a :class:`TraceContext` (see :mod:`spmd_backend.graph.meta`), and
* hands random ops to the context's ``rng`` (checkpoint recomputes replay the forward's draws:
  :mod:`spmd_backend.tracing.random_state`), and
* records which tensor each ``.item()`` read (``TraceContext.items``), so a step that returns
  ``loss.item()`` can return the tensor from the graph and take the number after it.

Nodes are found by walking the traced graph from its last node before the op to its last node
after it, so annotation costs O(new nodes) and survives functionalization (functional replays
are created inside the same dispatch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.utils._python_dispatch import TorchDispatchMode

from spmd_backend.graph.meta import Phase, annotate
from spmd_backend.tracing.fused_optim import INPLACE_TO_FUNCTIONAL, functional_fused_step
from spmd_backend.tracing.user_collectives import refusal

#: the symbolic Python numbers a traced ``.item()`` returns
SYM_TYPES = (torch.SymInt, torch.SymFloat, torch.SymBool)


@dataclass
class TraceContext:
    """Where the traced step currently is; consulted once per dispatched op.

    ``in_optimizer`` is toggled by optimizer step hooks; ``fqn_provider`` returns the owning
    module FQN for the current op (``None`` when unknown) and ``phase_provider`` may refine the
    phase (for example to ``recompute``); both are optional. Optimizer ops get no FQN here: the
    parameter they update is found after the trace (``annotate_optimizer_fqns``).
    """

    in_optimizer: bool = False
    fqn_provider: Callable[[], str | None] | None = None
    phase_provider: Callable[[Phase], Phase] | None = None
    #: ``tensor.item()`` calls of the step: the symbol of each result -> the tensor it read
    items: dict[Any, torch.Tensor] = field(default_factory=dict)
    #: runs the ops tagged ``nondeterministic_seeded`` (a
    #: :class:`~spmd_backend.tracing.random_state.RandomReplay`: checkpoint recomputes replay
    #: the forward's draws); None runs them as they are
    rng: Any = None

    def phase(self) -> Phase:
        if self.in_optimizer:
            base = Phase.OPTIMIZER
        elif torch._C._current_graph_task_id() != -1:
            base = Phase.BACKWARD
        else:
            base = Phase.FORWARD
        return self.phase_provider(base) if self.phase_provider is not None else base

    def fqn(self) -> str | None:
        if self.in_optimizer:
            return None
        return self.fqn_provider() if self.fqn_provider is not None else None




class TraceMode(TorchDispatchMode):
    """Rewrite untraceable ops and annotate the nodes each op creates."""

    def __init__(self, ctx: TraceContext) -> None:
        super().__init__()
        self.ctx = ctx
        self._graph: fx.Graph | None = None

    def __enter__(self) -> TraceMode:
        proxy_mode = get_proxy_mode()
        self._graph = proxy_mode.tracer.graph if proxy_mode is not None else None
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        graph = self._graph
        last = graph._root.prev if graph is not None else None
        if func in INPLACE_TO_FUNCTIONAL:
            functional_fused_step(func, args, kwargs)
            out = None
        elif func.namespace == "c10d":  # a collective the step issues under another name
            raise refusal(f"a torch.distributed collective ({func._schema.name})")
        elif self.ctx.rng is not None and torch.Tag.nondeterministic_seeded in func.tags:
            out = self.ctx.rng.run(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        if func is torch.ops.aten._local_scalar_dense.default and isinstance(out, SYM_TYPES):
            self.ctx.items[out.node.expr] = args[0]
        if graph is not None and last is not None:
            node = last.next
            if node is not graph._root:
                phase = self.ctx.phase()
                fqn = self.ctx.fqn()
                while node is not graph._root:
                    annotate(node, fqn=fqn, phase=phase)
                    node = node.next
        return out
