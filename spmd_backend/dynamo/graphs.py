"""Graph surgery for the Dynamo door: what Dynamo's and AOTAutograd's graphs hold, and the
markers that hand them to the one pipeline.

Dynamo gives the backend a torch-level ``fx.GraphModule`` whose placeholders carry a
``grapharg`` (the live example object and its structured ``Source``). Classification uses only
identities and ``Source`` *types* (never the printed source names):

* a parameter is an ``nn.Parameter`` example; its FQN is read off the ``Source`` chain
  (``_modules[...]`` keys and the ``_parameters`` key);
* a buffer is reached through a module's ``_buffers``; optimizer state through an
  ``OptimizerSource``; a gradient is a ``.grad`` (``GradSource``, or an ``AttrSource`` whose
  attribute is ``grad``).

Whole-step graphs (``loss.backward()`` traced as ``torch.autograd.grad``) get a ``grad_ready``
marker on each gradient (:func:`mark_gradients`) and ``buffer_sync`` markers on the buffers
(:func:`mark_buffers`) before AOTAutograd turns them into one functional aten graph; there
:func:`hoist_markers` moves each marker right after the node that computes its gradient (where
the compile door's tracer puts it) and :func:`annotate_phases` labels every node. Per-graph
(fallback) backward graphs get their markers from AOTAutograd's output descriptors
(:func:`mark_backward_outputs`).
"""

from __future__ import annotations

import operator
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from spmd_backend.dynamo import frame
from spmd_backend.dynamo.accumulated_grads import (
    accumulated_total,
    added_into_existing,
    copy_target,
    sum_before_adding,
)
from spmd_backend.errors import SpmdUsageError
from spmd_backend.graph import ops
from spmd_backend.graph.meta import INPUT_KIND_KEY, Phase, annotate, annotated, owner_of
from spmd_backend.graph.utils import get_output
from spmd_backend.tracing.markers import BUFFER_SYNC, GRAD_READY, check_dense_gradient


# ---------------------------------------------------------------------------- inputs
@dataclass
class DynamoInputs:
    """The placeholders of a Dynamo graph that are module or optimizer state, by position."""

    params: dict[int, nn.Parameter] = field(default_factory=dict)
    buffers: dict[int, torch.Tensor] = field(default_factory=dict)
    kinds: dict[int, str] = field(default_factory=dict)
    fqns: dict[int, str] = field(default_factory=dict)

    #: parameters the graph holds as attributes (an optimizer-step graph's static parameters)
    attributes: list[nn.Parameter] = field(default_factory=list)

    def state_tensors(self) -> list[torch.Tensor]:
        return [*self.params.values(), *self.buffers.values()]

    def state_names(self) -> list[str]:
        """The FQNs of :meth:`state_tensors`, in the same order."""
        return [self.fqns[i] for i in (*self.params, *self.buffers)]


def _chain(source: Any) -> list[Any]:
    out = []
    while source is not None:
        out.append(source)
        source = getattr(source, "base", None)
    return out


#: module internals on a Source chain that are not part of an FQN
_INTERNAL_ATTRS = frozenset({"_modules", "_parameters", "_buffers"})


def _through_dict(src: Any) -> bool:
    """``src`` reads an item of an object's ``__dict__``: once a step calls ``model.train()``
    or ``model.eval()``, Dynamo reaches module state as
    ``model.__dict__['_modules']['1'].__dict__['_buffers']['running_mean']``."""
    from torch._dynamo.source import AttrSource, DictGetItemSource

    base = getattr(src, "base", None)
    return (isinstance(src, DictGetItemSource) and isinstance(base, AttrSource)
            and base.member == "__dict__")


def _module_internal(src: Any, name: str) -> bool:
    """``src`` reads the attribute ``name`` (a module's ``_buffers``, an optimizer's
    ``param_groups``), in either spelling."""
    from torch._dynamo.source import AttrSource

    if isinstance(src, AttrSource):
        return src.member == name
    return _through_dict(src) and src.index == name


def source_fqn(source: Any) -> str:
    """``model._modules['fc1']._parameters['weight']`` (or, after ``model.train()`` in the step,
    ``model.__dict__['_modules']['fc1'].__dict__['_parameters']['weight']``) -> ``fc1.weight``,
    from Source objects (the local variable at the root is not part of the FQN)."""
    from torch._dynamo.source import AttrSource, DictGetItemSource, GetItemSource

    parts: list[str] = []
    for src in _chain(source):
        if isinstance(src, AttrSource):
            if src.member not in _INTERNAL_ATTRS and src.member != "__dict__":
                parts.append(src.member)
        elif _through_dict(src):
            if src.index not in _INTERNAL_ATTRS:
                parts.append(str(src.index))
        elif isinstance(src, (DictGetItemSource, GetItemSource)):
            parts.append(str(src.index))
    return ".".join(reversed(parts))


def _param_fqn(param: torch.Tensor, source: Any) -> str:
    """A parameter's FQN. Dynamo keeps the first source a frame reached a tensor through; when
    that was an optimizer (``opt.param_groups[0]['params'][3]``, a step that calls
    ``zero_grad()`` before the forward), the name comes from the frame's modules instead."""

    via_optimizer = any(_module_internal(s, "param_groups") for s in _chain(source))
    name = frame.parameter_name(param) if via_optimizer else None
    return name if name is not None else source_fqn(source)


def _kind(example: Any, source: Any) -> str:
    from torch._dynamo.source import AttrSource, GradSource, OptimizerSource

    if isinstance(example, nn.Parameter):
        return "param"
    chain = _chain(source)
    if chain and (isinstance(chain[0], GradSource) or (
        isinstance(chain[0], AttrSource) and chain[0].member == "grad"
    )):
        return "grad"
    if any(isinstance(s, OptimizerSource) for s in chain):
        return "state"
    if any(_module_internal(s, "_buffers") for s in chain):
        return "buffer"
    return "arg"


def classify_inputs(gm: fx.GraphModule) -> DynamoInputs:
    """Parameters, buffers and the kind of every placeholder of a Dynamo graph."""
    found = DynamoInputs()
    for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        grapharg = node.meta.get("grapharg")
        example = getattr(grapharg, "example", None)
        source = getattr(grapharg, "source", None)
        kind = _kind(example, source) if isinstance(example, torch.Tensor) else "arg"
        found.kinds[i] = kind
        if kind == "param":
            found.params[i] = example
            found.fqns[i] = _param_fqn(example, source)
        elif kind == "buffer":
            found.buffers[i] = example
            found.fqns[i] = source_fqn(source)
    found.attributes = [p for p in gm.parameters() if isinstance(p, nn.Parameter)]
    return found


def guard_parameter_identity(gm: fx.GraphModule, held: Collection[int]) -> None:
    """Guard that each parameter the graph reads that an optimizer of the frame holds (``id``
    in ``held``) is the object it was at trace time.

    Dynamo guards a parameter input on its shape and dtype only, and reads it through the
    first source the frame reached it by (``model.head.weight``); the optimizer's group reaches
    the same object, deduplicated into one input. After ``model.head = nn.Linear(...)`` with
    the optimizer untouched, the cached graph stepped the new head with the old head's state
    (eager leaves it alone: the optimizer does not hold it). Such a new object now recompiles
    (the optimizer's side is guarded by :mod:`spmd_backend.dynamo.faults`). Called while Dynamo
    compiles the frame (the backend runs inside its tracing context)."""
    from torch._dynamo.guards import GuardBuilder, install_guard

    for node in gm.graph.find_nodes(op="placeholder"):
        grapharg = node.meta.get("grapharg")
        source = getattr(grapharg, "source", None)
        if source is not None and id(getattr(grapharg, "example", None)) in held:
            install_guard(source.make_guard(GuardBuilder.ID_MATCH))


# ---------------------------------------------------------------------------- whole-step
def autograd_grad_calls(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function" and n.target is torch.autograd.grad]


def _accumulated_into_grad(value: fx.Node) -> bool:
    """Whether ``value`` (an output of ``torch.autograd.grad``) is what ``Tensor.backward``
    accumulates into ``.grad``: Dynamo traces ``backward()`` as ``autograd.grad`` plus its
    ``accumulate_grad`` polyfill, which copies each gradient into ``empty_like(param)``. A
    gradient the user asked ``torch.autograd.grad`` for (a gradient penalty) is not: DDP does
    not reduce it either."""
    return copy_target(value) is not None


def mark_gradients(gm: fx.GraphModule, inputs: DynamoInputs) -> list[int]:
    """``grad_ready(g, fqn)`` after each ``getitem(torch.autograd.grad(...), i)`` whose input
    ``i`` is a parameter and whose value ``backward()`` accumulates into ``.grad`` (an unused
    parameter's gradient is None: no marker; the result of the user's own
    ``torch.autograd.grad(..., create_graph=True)`` is not a gradient DDP reduces); returns the
    placeholder indices of the parameters marked (once per gradient)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    position = {p: i for i, p in enumerate(placeholders)}
    found: dict[int, list[fx.Node]] = {}  # parameter -> its gradients, one per backward call
    for call in autograd_grad_calls(gm.graph):
        wrt = call.args[1] if len(call.args) > 1 else call.kwargs.get("inputs")
        if not isinstance(wrt, (list, tuple)):  # torch.autograd.grad(out, x): one input
            wrt = (wrt,)
        for user in list(call.users):
            if user.target is not operator.getitem or user.meta.get("example_value") is None:
                continue
            i = position.get(wrt[user.args[1]])
            if i is None or i not in inputs.params or not _accumulated_into_grad(user):
                continue
            check_dense_gradient(user.meta["example_value"], inputs.fqns[i])
            found.setdefault(i, []).append(user)
    marked: list[int] = []
    order = {n: k for k, n in enumerate(gm.graph.nodes)}  # markers added below are not in it
    for i, gradients in found.items():
        total = accumulated_total(gm.graph, gradients)
        into_existing = added_into_existing(gm.graph, gradients) if total is None else None
        if into_existing is not None:  # .grad existed: the contributions' sum, marked, added
            add = sum_before_adding(into_existing)
            summed = add.args[1]
            with gm.graph.inserting_before(add):
                marker = gm.graph.call_function(GRAD_READY, (summed, inputs.fqns[i]))
            marker.meta["example_value"] = summed.meta["example_value"]
            add.args = (add.args[0], marker)
            marked.append(i)
            continue
        # several backward calls: the accumulated total once, after the last (as with no_sync)
        for value, after in [total] if total is not None else [(g, g) for g in gradients]:
            with gm.graph.inserting_after(after):
                marker = gm.graph.call_function(GRAD_READY, (value, inputs.fqns[i]))
            value.replace_all_uses_with(
                marker, delete_user_cb=lambda n, k=order[after]: order.get(n, -1) > k)
            marker.meta["example_value"] = value.meta["example_value"]
            marked.append(i)
    gm.graph.lint()
    gm.recompile()
    return marked


def _mutated_in_place(node: fx.Node) -> bool:
    return any(
        u.op == "call_method" and str(u.target).endswith("_") and not str(u.target).startswith("_")
        and u.args and u.args[0] is node
        for u in node.users
    )


def refuse_data_and_gradient_mutation(gm: fx.GraphModule, inputs: DynamoInputs) -> None:
    """Refuse a whole-step graph that mutates a parameter through ``.data`` and an incoming
    gradient in place (``p.data.add_(p.grad, alpha=-lr); p.grad.zero_()``, a hand-written
    update once the gradients exist).

    torch 2.13's AOTAutograd mis-orders its input-mutation epilogue for that graph (stock
    ``torch.compile`` with ``trace_autograd_ops`` too): the call failed copying a (16, 8)
    result into an (8,) input after it had already written the first parameter. Refused
    while compiling, before the graph runs; the same update under ``torch.no_grad()``
    without ``.data`` compiles."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    grads_mutated = any(
        inputs.kinds.get(i) == "grad" and _mutated_in_place(n) for i, n in enumerate(placeholders)
    )
    data_mutated = [
        n for n in gm.graph.nodes
        if n.op == "call_function" and n.target is torch._C._autograd._get_data_attr
        and _mutated_in_place(n)
    ]
    if grads_mutated and data_mutated:
        index = placeholders.index(data_mutated[0].args[0]) if data_mutated[0].args[0] in \
            placeholders else None
        name = inputs.fqns.get(index, "a parameter") if index is not None else "a parameter"
        raise SpmdUsageError(
            f'backend="spmd": the step updates {name!r} through .data in place and changes its '
            "gradient in place (p.data.add_(p.grad, ...); p.grad.zero_()); torch 2.13 cannot "
            "compile that pair correctly once the gradients exist. Write the update as "
            "`with torch.no_grad(): p.add_(p.grad, alpha=-lr)` (or use an optimizer), or compile "
            "with spmd_backend.compile"
        )


def functionalize_fused_optimizers(gm: fx.GraphModule) -> int:
    """``torch._fused_adam_(params, grads, ...)`` (and AdamW's, SGD's, Adagrad's) as the
    functional aten kernel plus ``copy_`` into each list it mutates: AOTAutograd cannot
    functionalize the in-place kernel (an empty ``max_exp_avg_sqs`` list fails), and the
    pipeline's lowering decomposes the functional one. A dynamic lr (a scheduler's float) is a
    tensor here already (the scope's ``_fused_lr_as_tensor``). Returns the number of kernels
    rewritten."""
    import spmd_backend.tracing.fused_optim  # noqa: F401 - meta kernels of the functional ops

    by_name = {(op._opname, op._overloadname): op for op in ops.FUSED_INPLACE_TO_FUNCTIONAL}
    graph = gm.graph
    count = 0
    for node in list(graph.nodes):
        name = getattr(node.target, "__name__", "")
        if node.op != "call_function" or node.target is not getattr(torch, name, None):
            continue
        kwargs = dict(node.kwargs)
        lr_kind = "tensor_lr" if isinstance(kwargs.get("lr"), fx.Node) else "default"
        overload = by_name.get((name, lr_kind))
        if overload is None:
            continue
        functional, mutated = ops.FUSED_INPLACE_TO_FUNCTIONAL[overload]
        with graph.inserting_before(node):
            out = graph.call_function(functional, node.args, kwargs)
            for i in range(mutated):
                results = graph.call_function(operator.getitem, (out, i))
                for j, dst in enumerate(node.args[i]):
                    src = graph.call_function(operator.getitem, (results, j))
                    graph.call_function(torch.ops.aten.copy_.default, (dst, src))
        graph.erase_node(node)
        count += 1
    if count:
        graph.lint()
        gm.recompile()
    return count


#: set on a buffer that a compiled graph broadcasts at its start (:func:`mark_buffers`): the
#: eager-gradient reduction does not broadcast it again after each ``backward()``
GRAPH_SYNCED_ATTR = "_spmd_broadcast_by_graph"


def mark_buffers(gm: fx.GraphModule, inputs: DynamoInputs) -> int:
    """``buf.copy_(buffer_sync(buf, fqn))`` at the start for every buffer the graph reads (DDP's
    ``broadcast_buffers``; the data-parallel expansion turns it into a broadcast); such a buffer
    tensor gets :data:`GRAPH_SYNCED_ATTR`."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    anchor = placeholders[-1] if placeholders else None
    count = 0
    for i in inputs.buffers:
        buf = placeholders[i]
        if not buf.users or anchor is None:
            continue
        with gm.graph.inserting_after(anchor):
            synced = gm.graph.call_function(BUFFER_SYNC, (buf, inputs.fqns[i]))
        with gm.graph.inserting_after(synced):
            anchor = gm.graph.call_function(torch.ops.aten.copy_.default, (buf, synced))
        for n in (synced, anchor):
            if "example_value" in buf.meta:
                n.meta["example_value"] = buf.meta["example_value"]
        setattr(inputs.buffers[i], GRAPH_SYNCED_ATTR, True)
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def hoist_markers(graph: fx.Graph) -> None:
    """Move each gradient marker right after the node that computes its gradient."""
    for marker in [n for n in graph.nodes if ops.is_grad_marker(n)]:
        producer = marker.args[0]
        if isinstance(producer, fx.Node):
            producer.append(marker)


def fold_gradient_copies(graph: fx.Graph) -> int:
    """``aten.copy(empty_like(p), grad_ready(g))`` -> ``grad_ready(g)``: the copy Dynamo's
    ``.grad`` stand-in makes of each new gradient (a parameter-sized buffer and a copy per
    parameter per step). Only where the copy's value has the marker's shape, dtype and strides,
    the ``empty_like`` feeds nothing else and every user of the copy only reads it (a ``.grad``
    that outlives the step, or one ``zero_grad(set_to_none=False)`` detaches in place, must be
    its own tensor, never a view of a bucket), so every reader sees the same values; the marker
    then reaches the optimizer directly (which the sharded reduce_scatter requires). Returns the
    number of copies folded.

    Only worth it with sharded optimizer state: without it, each copy is the first reader of
    its gradient's wait, so every wait lands before the optimizer; folded, a single-tensor
    optimizer's per-parameter updates interleave with later buckets' waits, which costs a
    rollback snapshot of everything they write each call (measured on the seed MLP with
    default Adam: 392 ms per step against 172 ms unfolded, docs/benchmarks.md)."""
    aten = torch.ops.aten
    folded = 0
    for node in list(graph.nodes):
        if not ops.is_call_to(node, aten.copy.default) or len(node.args) != 2 or node.kwargs:
            continue
        dst, src = node.args
        if not (isinstance(dst, fx.Node) and ops.is_call_to(dst, aten.empty_like.default)
                and len(dst.users) == 1 and isinstance(src, fx.Node) and ops.is_grad_marker(src)
                and all(ops.reads_only(u) for u in node.users)):
            continue
        a, b = node.meta.get("val"), src.meta.get("val")
        if a is None or b is None or (a.shape, a.dtype, a.stride()) != (b.shape, b.dtype, b.stride()):
            continue
        if not a.is_contiguous():  # a layout the real gradient may not have (channels_last)
            continue
        node.replace_all_uses_with(src)
        graph.erase_node(node)
        graph.erase_node(dst)
        folded += 1
    return folded


def annotate_phases(graph: fx.Graph, kinds: dict[int, str] | None = None,
                    default: Phase = Phase.FORWARD, *, split_optimizer: bool = False) -> None:
    """Phases of an AOTAutograd graph. Collectives and waits are ``comm``, gradient markers
    ``backward``, every other node ``default``; with ``split_optimizer`` (a whole-step graph)
    nodes AOT flags ``autograd_backward`` are ``backward``, nodes after the last backward node
    the optimizer's and nodes between two backward nodes recompute. Placeholders get their kind
    (``param``, ``buffer``...) from ``kinds``; markers the owning module's FQN."""
    nodes = list(graph.nodes)
    backward = [i for i, n in enumerate(nodes) if split_optimizer and (
        n.meta.get("autograd_backward") or ops.is_grad_marker(n))]
    first, last = (backward[0], backward[-1]) if backward else (len(nodes), -1)
    placeholder_index = 0
    for i, node in enumerate(nodes):
        if node.op == "placeholder":
            annotate(node, fqn=None, phase=Phase.INPUT)
            if kinds is not None:
                node.meta[INPUT_KIND_KEY] = kinds.get(placeholder_index, "arg")
            placeholder_index += 1
        elif node.op == "output":
            annotate(node, fqn=None, phase=Phase.OUTPUT)
        elif annotated(node):
            continue
        elif ops.is_grad_marker(node):
            annotate(node, fqn=owner_of(str(node.args[1])), phase=Phase.BACKWARD)
        elif ops.is_collective(node) or ops.is_wait(node):
            annotate(node, fqn=None, phase=Phase.COMM)
        elif split_optimizer and node.meta.get("autograd_backward"):
            annotate(node, fqn=None, phase=Phase.BACKWARD)
        elif i > last and backward:
            annotate(node, fqn=None, phase=Phase.OPTIMIZER)
        elif first < i < last:
            annotate(node, fqn=None, phase=Phase.RECOMPUTE)
        else:
            annotate(node, fqn=None, phase=default)


# ---------------------------------------------------------------------------- per graph
def mark_backward_outputs(graph: fx.Graph, params: dict[int, str]) -> list[int]:
    """In an AOT backward graph, wrap every output that is the gradient of a parameter input
    (descriptor ``GradAOTOutput(grad_of=PlainAOTInput(i))``) in ``grad_ready``; returns the
    parameter input positions marked. ``params`` maps input positions to FQNs."""
    from torch._functorch._aot_autograd.descriptors import GradAOTOutput, PlainAOTInput

    out = get_output(graph)
    descs = out.meta.get("desc") or ()
    values = list(out.args[0])
    marked: list[int] = []
    for pos, (value, desc) in enumerate(zip(values, descs)):
        if not isinstance(value, fx.Node) or not isinstance(desc, GradAOTOutput):
            continue
        base = desc.grad_of
        if not isinstance(base, PlainAOTInput) or base.idx not in params:
            continue
        if isinstance(value.meta.get("val"), torch.Tensor):  # the named refusal, not a pass's error
            check_dense_gradient(value.meta["val"], params[base.idx])
        with graph.inserting_after(value):
            marker = graph.call_function(GRAD_READY, (value, params[base.idx]))
        if "val" in value.meta:
            marker.meta["val"] = value.meta["val"]
        values[pos] = marker
        marked.append(base.idx)
    out.args = (tuple(values), *out.args[1:])
    graph.lint()
    return marked


def dynamo_input_positions(graph: fx.Graph) -> dict[int, int]:
    """AOT graph placeholder position -> the Dynamo graph input it stands for, from the
    placeholders' descriptors. AOTAutograd merges inputs that alias each other (a buffer that
    is a view of another) into one synthetic base, after which positions no longer line up
    (the base stands for the input it was made from); a placeholder of its own (an RNG seed, an
    effect token) stands for none. Without descriptors: position for position."""
    from torch._functorch._aot_autograd.descriptors import PlainAOTInput

    placeholders = graph.find_nodes(op="placeholder")
    if not any("desc" in p.meta for p in placeholders):
        return {k: k for k in range(len(placeholders))}
    found: dict[int, int] = {}
    for k, p in enumerate(placeholders):
        desc = p.meta.get("desc")
        while desc is not None and not isinstance(desc, PlainAOTInput):
            desc = getattr(desc, "base_of", None)
        if desc is not None:
            found[k] = desc.idx
    return found


def has_descriptors(graph: fx.Graph) -> bool:
    return get_output(graph).meta.get("desc") is not None
