"""Owning-module FQN and phase of every traced node.

During a trace, :class:`ModuleAnnotator` keeps a stack of running modules (global forward hooks,
state-dict FQNs, ``""`` for the root) and feeds :class:`~spmd_backend.tracing.dispatch.TraceContext`:

* forward ops belong to the innermost running module (ops between submodules belong to their
  parent; ops outside the model, such as the loss, to no module);
* backward ops belong to the module whose forward op they differentiate: each forward op's
  autograd sequence number is recorded with its FQN, and a backward op looks up the sequence
  number of the autograd node the engine is executing (a sibling that happens to be running
  does not matter);
* a module forward running during backward is an activation-checkpoint recompute: its ops get
  phase ``recompute`` and the checkpointed module's FQN.

After the trace, :func:`annotate_optimizer_fqns` gives optimizer nodes the FQN of the parameter
whose state they update (the chain of nodes that only feeds one parameter's write-back).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from spmd_backend.graph import ops
from spmd_backend.graph.meta import FQN_KEY, Phase, get_phase
from spmd_backend.graph.utils import node_inputs


class ModuleAnnotator:
    """The module stack of a trace, as FQN/phase providers for the TraceContext."""

    def __init__(self, root: nn.Module) -> None:
        self.names: dict[int, str] = {}
        for name, mod in root.named_modules(remove_duplicate=False):
            self.names.setdefault(id(mod), name)
        self.stack: list[tuple[str, bool]] = []  # (fqn, entered during backward)
        self.fqn_by_seq: dict[int, str | None] = {}

    # -- hooks
    def _pre(self, mod: nn.Module, args: Any) -> None:
        name = self.names.get(id(mod))
        if name is not None:
            self.stack.append((name, torch._C._current_graph_task_id() != -1))

    def _post(self, mod: nn.Module, args: Any, output: Any) -> None:
        name = self.names.get(id(mod))
        if name is not None and self.stack and self.stack[-1][0] == name:
            self.stack.pop()

    @contextmanager
    def active(self) -> Iterator[ModuleAnnotator]:
        handles = [
            register_module_forward_pre_hook(self._pre),
            register_module_forward_hook(self._post, always_call=True),
        ]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    # -- providers
    def _recompute_fqn(self) -> str | None:
        for name, in_bw in reversed(self.stack):
            if in_bw:
                return name
        return None

    def fqn(self) -> str | None:
        if torch._C._current_graph_task_id() == -1:
            fqn = self.stack[-1][0] if self.stack else None
            seq = torch.autograd._get_sequence_nr() - 1
            self.fqn_by_seq.setdefault(seq, fqn)
            return fqn
        recompute = self._recompute_fqn()
        if recompute is not None:
            return recompute
        node = torch._C._current_autograd_node()
        if node is None:
            return None
        return self.fqn_by_seq.get(node._sequence_nr())

    def phase(self, base: Phase) -> Phase:
        if base is Phase.BACKWARD and self._recompute_fqn() is not None:
            return Phase.RECOMPUTE
        return base


def annotate_optimizer_fqns(graph: fx.Graph, param_of_placeholder: dict[fx.Node, str]) -> None:
    """Give optimizer nodes the FQN of the one parameter whose state they update.

    Starting from each write-back ``copy_`` into a parameter's (or its optimizer state's)
    placeholder, walk back through optimizer nodes whose every user already belongs to that
    parameter. Nodes shared by several parameters (foreach/fused kernels) keep their FQN.
    """
    owner: dict[fx.Node, str] = {}
    for node in reversed(list(graph.nodes)):
        if ops.is_copy_(node) and node.args[0] in param_of_placeholder:
            param = param_of_placeholder[node.args[0]]
            if get_phase(node) is Phase.OPTIMIZER:
                owner[node] = param
            stack = [node]
            while stack:
                n = stack.pop()
                for inp in node_inputs(n):
                    if inp in owner or get_phase(inp) is not Phase.OPTIMIZER:
                        continue
                    if all(owner.get(u) == param for u in inp.users):
                        owner[inp] = param
                        stack.append(inp)
    for node, param in owner.items():
        node.meta[FQN_KEY] = param
