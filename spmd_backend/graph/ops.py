"""Op predicates: the single place that decides what kind of node a node is.

Every predicate matches on ``node.op`` and ``node.target`` (op overloads), never on node names,
so renaming nodes or re-tracing cannot change what a pass sees. Targets are resolved lazily for
the backend's own marker ops, which are registered by :mod:`spmd_backend.tracing.markers`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.fx as fx

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

#: Functional collectives that produce a tensor which must be waited on.
COLLECTIVE_TARGETS: frozenset = frozenset(
    {
        c10d.all_reduce.default,
        c10d.all_reduce_coalesced.default,
        c10d.all_gather_into_tensor.default,
        c10d.reduce_scatter_tensor.default,
        c10d.broadcast.default,
        c10d.all_to_all_single.default,
    }
)

ALL_REDUCE_TARGETS: frozenset = frozenset({c10d.all_reduce.default})
ALL_GATHER_TARGETS: frozenset = frozenset({c10d.all_gather_into_tensor.default})
WAIT_TARGETS: frozenset = frozenset({c10d.wait_tensor.default})

#: Functional (out-of-place) fused optimizer kernels; args[0] are params, args[1] gradients.
FUSED_OPTIMIZER_TARGETS: frozenset = frozenset(
    {
        aten._fused_adam.default,
        aten._fused_adam.tensor_lr,
        aten._fused_adamw.default,
        aten._fused_adamw.tensor_lr,
        aten._fused_sgd.default,
        aten._fused_sgd.tensor_lr,
        aten._fused_adagrad.default,
        aten._fused_adagrad.tensor_lr,
    }
)

#: in-place fused optimizer op -> (its functional variant, number of leading tensor lists it
#: mutates: params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs for Adam(W); params, grads,
#: momentum buffers for SGD; params, grads, state sums (and, by the float-lr schema only, the
#: unchanged step counts) for Adagrad)
FUSED_INPLACE_TO_FUNCTIONAL: dict = {
    aten._fused_adam_.default: (aten._fused_adam.default, 5),
    aten._fused_adam_.tensor_lr: (aten._fused_adam.tensor_lr, 5),
    aten._fused_adamw_.default: (aten._fused_adamw.default, 5),
    aten._fused_adamw_.tensor_lr: (aten._fused_adamw.tensor_lr, 5),
    aten._fused_sgd_.default: (aten._fused_sgd.default, 3),
    aten._fused_sgd_.tensor_lr: (aten._fused_sgd.tensor_lr, 3),
    aten._fused_adagrad_.default: (aten._fused_adagrad.default, 4),
    aten._fused_adagrad_.tensor_lr: (aten._fused_adagrad.tensor_lr, 3),
}

#: functional fused optimizer op -> number of leading tensor lists its in-place variant mutates
FUSED_MUTATED_LISTS: dict = {f: n for f, n in FUSED_INPLACE_TO_FUNCTIONAL.values()}

#: ``scalar ** tensor`` ops: in an optimizer these are bias corrections ``beta ** step``
SCALAR_POW_TARGETS: frozenset = frozenset({aten.pow.Scalar, aten._foreach_pow.ScalarAndTensor})

#: tensor concatenation (lowering/cat_layout.py keeps eager's layout where Inductor would not)
CAT_TARGETS: frozenset = frozenset({aten.cat.default})

PROFILER_TARGETS: frozenset = frozenset(
    {
        torch.ops.profiler._record_function_enter.default,
        torch.ops.profiler._record_function_enter_new.default,
        torch.ops.profiler._record_function_exit._RecordFunction,
    }
)


def _is_call(node: fx.Node, targets: Iterable[object]) -> bool:
    return node.op == "call_function" and node.target in targets


def is_call_to(node: fx.Node, target: object) -> bool:
    """True when ``node`` calls exactly ``target`` (an op overload or callable)."""
    return node.op == "call_function" and node.target is target


def is_collective(node: fx.Node) -> bool:
    """A functional collective whose result must be passed through ``wait_tensor``."""
    return _is_call(node, COLLECTIVE_TARGETS)


def is_all_reduce(node: fx.Node) -> bool:
    return _is_call(node, ALL_REDUCE_TARGETS)


def is_reduce_scatter(node: fx.Node) -> bool:
    return is_call_to(node, c10d.reduce_scatter_tensor.default)


def is_all_gather(node: fx.Node) -> bool:
    return _is_call(node, ALL_GATHER_TARGETS)


def is_broadcast(node: fx.Node) -> bool:
    return is_call_to(node, c10d.broadcast.default)


def is_wait(node: fx.Node) -> bool:
    return _is_call(node, WAIT_TARGETS)


def is_fused_optimizer(node: fx.Node) -> bool:
    """A functional fused optimizer kernel (``_fused_adam(w)``, ``_fused_sgd``, ``_fused_adagrad``).
    """
    return _is_call(node, FUSED_OPTIMIZER_TARGETS)


def is_fused_optimizer_kernel(node: fx.Node) -> bool:
    """A fused optimizer kernel, functional or in place (``_fused_adam_`` too)."""
    return is_fused_optimizer(node) or _is_call(node, FUSED_INPLACE_TO_FUNCTIONAL)


def is_foreach(node: fx.Node) -> bool:
    """Any ``aten._foreach_*`` op (functional or in-place)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    return node.target.namespace == "aten" and node.target.__name__.startswith("_foreach_")


def list_arguments(node: fx.Node) -> list[tuple[str, list]]:
    """``(schema name, list)`` for every positional list argument of ``node`` (a foreach or
    fused optimizer op: ``params``, ``grads``, ``state_steps``, ...); a list past the schema is
    named ``argument <position>``."""
    schema = getattr(node.target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    return [(names[i] if i < len(names) else f"argument {i}", list(a))
            for i, a in enumerate(node.args) if isinstance(a, (list, tuple))]


def op_name(node: fx.Node) -> str:
    """The overload packet name of a call (``"_fused_adam_"``, ``"_foreach_add"``), else ""."""
    target = node.target
    if node.op == "call_function" and isinstance(target, torch._ops.OpOverload):
        return target._overloadpacket.__name__
    return ""


def is_list_op(node: fx.Node) -> bool:
    """A foreach or fused optimizer op (functional or in-place)."""
    name = op_name(node)
    return name.startswith("_foreach_") or name.startswith("_fused_")


def is_copy_(node: fx.Node) -> bool:
    return is_call_to(node, aten.copy_.default)


def is_getitem(node: fx.Node) -> bool:
    import operator

    return node.op == "call_function" and node.target is operator.getitem


def is_profiler_op(node: fx.Node) -> bool:
    return _is_call(node, PROFILER_TARGETS)


def is_detach(node: fx.Node) -> bool:
    return is_call_to(node, aten.detach.default)


def is_view_target(target: object) -> bool:
    """An op overload whose result aliases an input without writing it (``view``, ``detach``,
    ``t``, ``slice``...: its "in-place" form would rewrite the input's metadata)."""
    schema = getattr(target, "_schema", None)
    return schema is not None and any(
        r.alias_info is not None and not r.alias_info.is_write for r in schema.returns
    )


def is_view(node: fx.Node) -> bool:
    return node.op == "call_function" and is_view_target(node.target)


def view_root(node: fx.Node) -> fx.Node:
    """What ``node`` is a view of, through any chain of views (``node`` itself if none)."""
    while is_view(node) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def reads_only(node: fx.Node) -> bool:
    """An op call that neither writes its inputs nor is anything but an op (not the output)."""
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and schema is not None and not schema.is_mutable


def is_placeholder(node: fx.Node) -> bool:
    return node.op == "placeholder"


def _marker(name: str) -> object | None:
    ns = getattr(torch.ops, "spmd_backend", None)
    if ns is None:
        return None
    try:
        return getattr(ns, name).default
    except (AttributeError, RuntimeError):
        return None


def is_grad_marker(node: fx.Node) -> bool:
    """The tracer's ``spmd_backend.grad_ready`` marker: a gradient that just became final."""
    target = _marker("grad_ready")
    return target is not None and is_call_to(node, target)


def is_grad_contribution_marker(node: fx.Node) -> bool:
    """The tracer's ``spmd_backend.grad_contribution`` marker: one backward's contribution to a
    gradient that already held a reduced value (accumulation across calls)."""
    target = _marker("grad_contribution")
    return target is not None and is_call_to(node, target)


def is_grad_shard_marker(node: fx.Node) -> bool:
    """The tracer's ``spmd_backend.grad_shard`` marker: this rank's slice of a reduced gradient
    (sharded optimizer state)."""
    target = _marker("grad_shard")
    return target is not None and is_call_to(node, target)


def is_param_gather_marker(node: fx.Node) -> bool:
    """The tracer's ``spmd_backend.param_gather`` marker: every rank's updated parameter shard."""
    target = _marker("param_gather")
    return target is not None and is_call_to(node, target)


def is_buffer_marker(node: fx.Node) -> bool:
    """The tracer's ``spmd_backend.buffer_sync`` marker: a buffer read at the start of a step."""
    target = _marker("buffer_sync")
    return target is not None and is_call_to(node, target)


def is_compiled_autograd_accumulate(node: fx.Node) -> bool:
    """Compiled autograd's ``AccumulateGrad`` (or Inductor's ``accumulate_grad_``): where its
    backward graph writes a ``.grad``."""
    if node.op != "call_function":
        return False
    from torch._dynamo.compiled_autograd import ops as compiled_autograd_ops

    targets = [getattr(compiled_autograd_ops, "AccumulateGrad", None)]
    inductor = getattr(torch.ops, "inductor", None)
    accumulate = getattr(inductor, "accumulate_grad_", None) if inductor is not None else None
    if accumulate is not None:
        targets.append(accumulate.default)
    return any(t is not None and node.target is t for t in targets)


def written_nodes(node: fx.Node) -> list[fx.Node]:
    """The nodes ``node`` writes in place: a ``copy_``'s destination, the arguments its schema
    marks as written (an in-place fused optimizer's parameter and state lists)."""
    if is_copy_(node):
        return [node.args[0]] if isinstance(node.args[0], fx.Node) else []
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return []
    out: list[fx.Node] = []
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        fx.node.map_arg(value, out.append)
    return out


def has_side_effect(node: fx.Node) -> bool:
    """Nodes dead-code elimination must keep: mutations, collectives, waits, impure calls."""
    if node.op in ("placeholder", "output"):
        return True
    if node.op != "call_function":
        return False
    if is_collective(node) or is_wait(node) or is_profiler_op(node):
        return True
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        if target._schema.is_mutable:
            return True
    return bool(getattr(node, "is_impure", lambda: False)())
