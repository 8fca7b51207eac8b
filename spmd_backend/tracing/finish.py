"""Clean a raw make_fx step graph: profiler/detach nodes, redundant copies, names, annotations.

:func:`finish_graph` drops profiler record-function nodes and ``detach`` (the graph runs under
``no_grad``), elides functional ``aten.copy`` nodes that merely reproduce their source, gives
placeholders readable names (``p_<fqn>``, ``b_``, ``s_``, ``h_``, ``g_``, ``x_``, ``a_``) and input
annotations, annotates the write-back epilogue, switches to flat-argument code generation and
removes dead code (keeping side effects). It returns the placeholder names.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from spmd_backend.errors import SpmdTraceError
from spmd_backend.graph import ops
from spmd_backend.graph.meta import (
    FQN_KEY,
    INPUT_KIND_KEY,
    PARAM_NAME_KEY,
    Phase,
    annotate,
    annotated,
    get_phase,
    owner_of,
)
from spmd_backend.tracing.binding import StepBinding
from spmd_backend.tracing.layout import StepLayout


def _sanitize(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)



def _is_redundant_functional_copy(node: fx.Node) -> bool:
    if not ops.is_call_to(node, torch.ops.aten.copy.default) or len(node.args) < 2:
        return False
    dst, src = node.args[0], node.args[1]
    if not isinstance(dst, fx.Node) or not isinstance(src, fx.Node):
        return False
    a, b = dst.meta.get("val"), src.meta.get("val")
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return False
    # a copy into a non-contiguous destination (a channels_last parameter's layout) is kept:
    # the source's traced strides are a prediction the real kernel need not follow (a CPU
    # convolution's weight gradient comes back contiguous where the fake one is channels_last)
    return (
        a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
        and a.stride() == b.stride() and a.is_contiguous()
    )


def _owner_label(fqn: str | None) -> str:
    if fqn is None:
        return "the step, outside the model"
    return f"module {fqn!r}" if fqn else "the model's root module"


def _refuse_effect_tokens(graph: fx.Graph, extra_inputs: int) -> None:
    """torch threads an effect token through ops it registers as side-effecting (the matrix
    check in the backward of ``torch.linalg.solve``/``inv``): an input and an output of the
    graph this tracer does not plan. Refused naming the ops (until 2026-11-28: an internal
    placeholder-count error; hunt 36, peft's BOFT)."""
    nodes = [n for n in graph.nodes
             if n.op == "call_function" and n.target is torch.ops.higher_order.with_effects]
    effectful = sorted({str(n.args[1]) for n in nodes})
    if effectful and extra_inputs > 0:
        owners = sorted({_owner_label(n.meta.get(FQN_KEY)) for n in nodes})
        raise SpmdTraceError(
            f"spmd_backend.compile cannot trace {', '.join(effectful)} (in "
            f"{', '.join(owners)}): torch orders it with an effect token "
            "(torch.linalg functions such as solve, inv and cholesky check their matrix so, "
            'in forward or backward); compile the step with torch.compile(step, backend="spmd"), '
            "which handles the token. Nothing was changed."
        )


def finish_graph(gm: fx.GraphModule, binding: StepBinding, layout: StepLayout) -> list[str]:
    """Clean the raw make_fx graph: drop profiler/detach nodes, name and annotate I/O."""
    graph = gm.graph
    for node in reversed(list(graph.nodes)):
        if ops.is_profiler_op(node) and not node.users:
            graph.erase_node(node)
        elif ops.is_detach(node):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
        elif _is_redundant_functional_copy(node):
            # `dst.copy_(src)` on a functional tensor becomes `aten.copy(dst, src)`: when src
            # already has dst's metadata the result is just src (the write-back copy_ to the
            # input, if any, stays)
            node.replace_all_uses_with(node.args[1])
            graph.erase_node(node)

    # readable placeholder names and input annotations
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    labels: list[tuple[str, str | None, str]] = []
    for names in binding.param_names:
        labels.append((f"p_{_sanitize(names[0])}", owner_of(names[0]), "param"))
    for names in binding.buffer_names:
        labels.append((f"b_{_sanitize(names[0])}", owner_of(names[0]), "buffer"))
    for i, k in layout.state_inputs:
        name = binding.param_names[i][0]
        labels.append((f"s_{_sanitize(name)}_{_sanitize(str(k))}", owner_of(name), "state"))
    for g, k, e in layout.hyper_inputs:
        suffix = "" if e is None else f"_{e}"
        labels.append((f"h_{_sanitize(k)}{suffix}_g{g}", None, "hyper"))
    for i in layout.grad_inputs:
        name = binding.param_names[i][0]
        labels.append((f"g_{_sanitize(name)}", owner_of(name), "grad"))
    for o, attr in layout.aux_inputs:
        labels.append((f"x_{type(binding.aux_objects[o]).__name__}{o}_{_sanitize(attr)}", None, "aux"))
    paths = binding.arg_paths()
    for j in layout.arg_inputs:
        labels.append((f"a_{_sanitize(paths[j]).strip('_')}", None, "arg"))
    _refuse_effect_tokens(graph, len(placeholders) - len(labels))
    if len(labels) != len(placeholders):
        raise SpmdTraceError(
            f"internal: {len(placeholders)} placeholders for {len(labels)} planned inputs"
        )
    for node, (label, fqn, kind) in zip(placeholders, labels):
        node._rename(label)
        annotate(node, fqn=fqn, phase=Phase.INPUT)
        node.meta[INPUT_KIND_KEY] = kind
    for node, names in zip(placeholders, binding.param_names):
        node.meta[PARAM_NAME_KEY] = names[0]

    # epilogue copies (and anything else made outside the dispatch mode) inherit a phase
    for node in graph.nodes:
        if node.op == "output":
            annotate(node, fqn=None, phase=Phase.OUTPUT)
        elif not annotated(node):
            src = node.args[1] if ops.is_copy_(node) and len(node.args) > 1 else None
            dst = node.args[0] if ops.is_copy_(node) else None
            phase = get_phase(src) if isinstance(src, fx.Node) else None
            fqn = dst.meta.get("spmd_fqn") if isinstance(dst, fx.Node) else None
            annotate(node, fqn=fqn, phase=phase or Phase.OPTIMIZER)

    graph._codegen = fx.graph.CodeGen()
    graph.eliminate_dead_code(is_impure_node=ops.has_side_effect)
    graph.lint()
    return [n.name for n in placeholders]
