"""Whether a traced step keeps the replicas identical: no write to replicated state may depend on
a rank's own data except through a collective.

Data parallelism holds the same parameters and optimizer state on every rank because every
value that updates them is either replicated already (parameters, state, hyper-parameters) or
has passed a collective (a reduced gradient, a broadcast buffer). A gradient the step computes
with ``torch.autograd.grad`` and assigns to ``.grad`` (PCGrad and other gradient surgery), a
reduced gradient plus a local term, an update scaled by the batch's loss: each reaches the
update without a collective, so every rank steps differently and the replicas drift apart with
no error. DDP behaves the same (its reducer hooks only ``backward()``), so parity with DDP does
not catch it.

:func:`rank_local_writes` finds such writes in a traced graph before it runs, by following
values from the rank-local inputs: tensor arguments of more than one element (a batch; a
one-element tensor argument is taken as a setting passed the same on every rank). A value
derived from one is rank-local until a marker of the gradient or buffer collectives or a
functional collective (the step's own ``all_reduce``) consumes it. Reported writes: a ``copy_``
into a replicated input (the write-back of parameters and optimizer state), a fused or in-place
kernel mutating one, and graph outputs that become replicated state (final gradients, new
optimizer state). A value is followed through what carries its values: not through ops that
take only a tensor's shape (``empty_like``), and through ``copy(self, src)`` from ``src`` only
(functionalization writes an in-place collective's result back that way). Random ops are not
sources: ranks seeded alike draw alike.

:func:`refuse_rank_local_writes` labels the compile door's graph from its layout;
``backend.py`` labels the Dynamo door's whole-step graph from its classified inputs; both raise
:func:`drift_error`.

Requires the traced graph with its markers (before the data-parallel expansion). Guarantees:
reads the graph only; one pass in topological order.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.fx as fx

from spmd_backend.errors import SpmdUsageError
from spmd_backend.graph.ops import (
    is_buffer_marker,
    is_collective,
    is_grad_contribution_marker,
    is_grad_marker,
    is_grad_shard_marker,
    is_param_gather_marker,
    is_wait,
    written_nodes,
)

if TYPE_CHECKING:
    from spmd_backend.tracing.binding import StepBinding
    from spmd_backend.tracing.layout import StepLayout


@dataclass(frozen=True)
class RankLocalWrite:
    """A write to replicated state that depends on a rank's own data without a collective."""

    #: what is written: "parameter 'fc.weight'", "the gradient of 'fc.weight'" ...
    target: str
    #: the rank-local input it depends on: "argument args[2][0]"
    source: str


#: a node's rank-local origin: None, a label, or one per element of a list output (nested)
Taint = object


def _synchronizes(node: fx.Node) -> bool:
    """A node whose output is the same on every rank whatever its inputs."""
    return (is_grad_marker(node) or is_grad_contribution_marker(node) or is_buffer_marker(node)
            or is_grad_shard_marker(node) or is_param_gather_marker(node) or is_collective(node)
            or is_wait(node))


def _flat_nodes(args: object) -> list[fx.Node]:
    out: list[fx.Node] = []
    fx.node.map_arg(args, out.append)  # type: ignore[arg-type]
    return out


def rank_local_writes(
    graph: fx.Graph,
    local_inputs: Mapping[int, str],
    replicated_inputs: Mapping[int, str],
    replicated_outputs: Mapping[int, str],
) -> list[RankLocalWrite]:
    """The writes to replicated state in ``graph`` that depend on a rank-local input.

    ``local_inputs``: placeholder position -> label of each rank-local input;
    ``replicated_inputs``: placeholder position -> label of each input that holds replicated
    state (a write into it is checked); ``replicated_outputs``: output position -> label of
    each output that becomes replicated state. One write per target, in graph order.
    """
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    taint: dict[fx.Node, Taint] = {placeholders[i]: label for i, label in local_inputs.items()
                                   if i < len(placeholders)}
    replicated = {placeholders[i]: label for i, label in replicated_inputs.items()
                  if i < len(placeholders)}
    found: dict[str, RankLocalWrite] = {}

    def report(target: fx.Node | None, origin: Taint, label: str | None = None) -> None:
        first = _first(origin)
        if first is None:
            return
        if label is None:
            if target not in replicated:
                return
            label = replicated[target]  # type: ignore[index]
        found.setdefault(label, RankLocalWrite(label, first))

    for node in graph.nodes:
        if node.op == "output":
            outs = node.args[0] if isinstance(node.args[0], (list, tuple)) else [node.args[0]]
            for pos, label in replicated_outputs.items():
                value = outs[pos] if pos < len(outs) else None
                if isinstance(value, fx.Node):
                    report(None, taint.get(value), label)
            continue
        if node.op != "call_function" or _synchronizes(node):
            continue
        if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
            whole = taint.get(node.args[0])
            index = node.args[1]
            part = whole[index] if isinstance(whole, list) and isinstance(index, int) \
                and index < len(whole) else whole
            if _first(part) is not None:
                taint[node] = part
            continue
        per_element = _list_op_taint(node, taint)
        if per_element is not None:
            written, result = per_element
            for target, origin in written:
                report(target, origin)
            if _first(result) is not None:
                taint[node] = result
            continue
        origin = _first([taint.get(n) for n in _data_inputs(node)])
        if origin is None:
            continue
        taint[node] = origin
        # a mutation of a replicated input by a rank-local value: the write-back's copy_
        for target in written_nodes(node):
            report(target, origin)
    return list(found.values())


#: ops whose result holds none of their tensor arguments' values (only their shape, dtype,
#: device): a freshly made tensor
_METADATA_ONLY = frozenset({
    torch.ops.aten.empty_like.default, torch.ops.aten.zeros_like.default,
    torch.ops.aten.ones_like.default, torch.ops.aten.full_like.default,
    torch.ops.aten.new_empty.default, torch.ops.aten.new_zeros.default,
    torch.ops.aten.new_ones.default, torch.ops.aten.new_full.default,
    torch.ops.aten.new_empty_strided.default,
})
#: ops whose result holds the values of one argument only: ``copy(self, src)`` (functional
#: ``copy_``, as functionalization writes an in-place collective's result back) is ``src``
_VALUES_FROM = {
    torch.ops.aten.copy.default: 1,
    torch.ops.aten.copy_.default: 1,
}


def _data_inputs(node: fx.Node) -> list[fx.Node]:
    """The nodes whose values ``node``'s result can hold."""
    if node.target in _METADATA_ONLY:
        return []
    if node.target in _VALUES_FROM:
        index = _VALUES_FROM[node.target]
        return _flat_nodes(node.args[index]) if index < len(node.args) else []
    return _flat_nodes((node.args, node.kwargs))


def _first(taint: object) -> str | None:
    """The first rank-local origin in ``taint`` (a label, or a nested list of them)."""
    if isinstance(taint, str):
        return taint
    if isinstance(taint, list):
        for t in taint:
            found = _first(t)
            if found is not None:
                return found
    return None


def _list_op_taint(
    node: fx.Node, taint: Mapping[fx.Node, object]
) -> tuple[list[tuple[fx.Node, object]], object] | None:
    """Element-wise taint of a multi-tensor op (``_foreach_*``, a fused optimizer kernel): the
    i-th result and the i-th written tensor depend on the i-th elements of the list arguments
    and on every non-list argument. ``(written (node, origin) pairs, result taint)``, or None for
    an op without list arguments."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return None
    schema = node.target._schema
    lists: list[tuple[int, list]] = []
    shared: list[object] = []
    for i, arg in enumerate(schema.arguments):
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        if isinstance(value, (list, tuple)) and str(arg.type).startswith("List[Tensor"):
            lists.append((i, list(value)))
        elif value is not None:
            shared.extend(taint.get(n) for n in _flat_nodes(value))
    if not lists:
        return None
    n = len(lists[0][1])
    common = _first(shared)
    per: list[object] = []
    for k in range(n):
        origin = common or _first([taint.get(v[k]) if k < len(v) and isinstance(v[k], fx.Node)
                                   else None for _, v in lists])
        per.append(origin)
    written: list[tuple[fx.Node, object]] = []
    for i, value in lists:
        info = schema.arguments[i].alias_info
        if info is not None and info.is_write:
            written.extend((v, per[k]) for k, v in enumerate(value)
                           if k < n and isinstance(v, fx.Node))
    returns = schema.returns
    if len(returns) == 1 and str(returns[0].type).startswith("List[Tensor"):
        result: object = per
    elif returns and all(str(r.type).startswith("List[Tensor") for r in returns):
        result = [list(per) for _ in returns]
    else:
        result = _first(per)
    return written, result


def describe(writes: Sequence[RankLocalWrite]) -> str:
    """The writes as one sentence for an error."""
    first = writes[0]
    more = f" (and {len(writes) - 1} more)" if len(writes) > 1 else ""
    return f"{first.target}{more} is updated from {first.source}"


def refuse_rank_local_writes(graph: fx.Graph, layout: StepLayout, binding: StepBinding) -> None:
    """Raise :class:`SpmdUsageError` when the compile door's traced ``graph`` (placeholders and
    outputs as ``layout`` orders them) writes replicated state from a rank's own batch."""
    names = [n[0] for n in binding.param_names]
    paths = binding.arg_paths()
    pos = layout.n_params + layout.n_buffers
    replicated_inputs: dict[int, str] = {i: f"parameter {names[i]!r}" for i in range(layout.n_params)}
    for k, (i, key) in enumerate(layout.state_inputs):
        replicated_inputs[pos + k] = f"optimizer state {key!r} of {names[i]!r}"
    pos += len(layout.state_inputs) + len(layout.hyper_inputs)
    for k, i in enumerate(layout.grad_inputs):
        replicated_inputs[pos + k] = f"the gradient of {names[i]!r}"
    pos += len(layout.grad_inputs) + len(layout.aux_inputs)
    local_inputs: dict[int, str] = {}
    for k, j in enumerate(layout.arg_inputs):
        arg = binding.flat_args[j]
        if isinstance(arg, torch.Tensor) and arg.numel() > 1:
            local_inputs[pos + k] = f"argument {paths[j]}"
    out = layout.n_user_tensors
    replicated_outputs: dict[int, str] = {}
    for k, (i, key) in enumerate(layout.state_outputs):
        replicated_outputs[out + k] = f"optimizer state {key!r} of {names[i]!r}"
    out += len(layout.state_outputs)
    for k, i in enumerate(layout.grad_outputs):
        replicated_outputs[out + k] = f"the gradient of {names[i]!r}"
    writes = rank_local_writes(graph, local_inputs, replicated_inputs, replicated_outputs)
    if writes:
        raise drift_error(writes, "spmd_backend.compile", graph)


def drift_error(writes: Sequence[RankLocalWrite], door: str, graph: fx.Graph) -> SpmdUsageError:
    """The refusal of a step with rank-local writes in ``graph``, worded for ``door``
    ("spmd_backend.compile" or 'backend="spmd"')."""
    if door == "spmd_backend.compile":
        fix = ('or compile with torch.compile(step, backend="spmd") and dist.all_reduce the '
               "gradients you compute; if that argument holds the same values on every rank, "
               "pass DataParallel(check_consistency=False)")
    else:
        fix = ("or dist.all_reduce the gradients you compute before using them (the collective "
               "is captured in the graph); if that input holds the same values on every rank, "
               'pass options={"check_consistency": False}')
    if any("embedding_renorm" in str(n.target) for n in graph.nodes):
        # the rows this rank's batch looks up are renormalized in place in forward
        fix += (". nn.Embedding(max_norm=...) does this: it renormalizes, in place and in "
                "forward, the rows this rank's batch looks up, so under DDP too the ranks' "
                "embedding weights differ after the first step; renormalize the weight in the "
                "step after optimizer.step() instead (with torch.no_grad(), all rows alike)")
    return SpmdUsageError(
        f"{door}: {describe(writes)} without passing a gradient collective, so each rank "
        "would update it differently and the replicas would drift apart (DDP would too: it "
        "averages only the gradients backward() accumulates). A gradient from "
        "torch.autograd.grad assigned to .grad, a local term added to a reduced gradient or an "
        "update scaled by this rank's loss does this. Let loss.backward() produce the "
        f"gradients (combine the losses first), {fix}. Nothing was changed."
    )
