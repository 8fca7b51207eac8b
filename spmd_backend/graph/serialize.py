"""A graph module to bytes and back, exactly and fast.

Used to cache a compiled step (:mod:`spmd_backend.dynamo.step_cache`): the bytes hold every
node in order with its op, name, target, arguments and the backend's own metadata (keys that
start with ``spmd_``), and the tensors the graph reads through ``get_attr``.

Requires: call targets that are operator overloads or packets (their library loaded when the
bytes are read: aten, ``_c10d_functional``, ``spmd_backend``...), higher-order operators whose
operands are not subgraphs, or importable functions (builtins, ``operator.getitem``,
module-level functions); ``get_attr`` values that are real tensors (so no subgraph modules;
tensors that share storage come back as separate copies); node arguments made of nodes and plain values (numbers, strings,
dtypes, devices, lists, tuples, dicts, slices). Guarantees: ``load(dump(gm))`` has the same
nodes in the same order with the same names, targets, arguments, type annotations and
``spmd_*`` metadata, so
its generated code is the same; nothing else of the node metadata travels (placeholders'
example values are the caller's business). Anything else raises
:class:`~spmd_backend.errors.SpmdSerializationError` naming the node or attribute. Unlike
``pickle.dumps(gm)``, which re-traces the generated code and folds constant subexpressions (a
``lift_fresh_copy`` of a constant comes back as the constant itself), nothing is re-traced.
"""

from __future__ import annotations

import io
import operator
import pickle
from typing import Any

import torch
import torch.fx as fx

from spmd_backend.errors import SpmdSerializationError

#: node metadata keys that travel: the backend's own
META_PREFIX = "spmd_"


class _Ref(int):
    """A reference to the node at this position, in a pickled argument."""


def _overload(namespace: str, name: str, overload: str) -> Any:
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


def _packet(namespace: str, name: str) -> Any:
    return getattr(getattr(torch.ops, namespace), name)


def _higher_order(name: str) -> Any:
    return getattr(torch.ops.higher_order, name)


def _torch_global(name: str) -> Any:
    return getattr(torch, name)


class _Pickler(pickle.Pickler):
    def __init__(self, buffer: io.BytesIO, positions: dict[fx.Node, int]) -> None:
        super().__init__(buffer, protocol=pickle.HIGHEST_PROTOCOL)
        self.positions = positions

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, fx.Node):
            return _Ref, (self.positions[obj],)
        if isinstance(obj, torch._ops.OpOverload):
            return _overload, (obj.namespace, obj._opname, obj._overloadname)
        if isinstance(obj, torch._ops.OpOverloadPacket):
            namespace, name = obj._qualified_op_name.split("::")
            return _packet, (namespace, name)
        if isinstance(obj, torch._ops.HigherOrderOperator):
            return _higher_order, (obj.name(),)
        if isinstance(obj, (torch.memory_format, torch.layout)):
            # by name: pickle would name the first module it finds them through (the user's
            # script, a worker's own module), which the reading process may not have
            return _torch_global, (str(obj).removeprefix("torch."),)
        if isinstance(obj, torch._subclasses.fake_tensor.FakeTensor):
            raise SpmdSerializationError("a fake tensor cannot be written")
        return NotImplemented


def _attributes(gm: fx.GraphModule) -> dict[str, torch.Tensor]:
    attrs: dict[str, torch.Tensor] = {}
    for node in gm.graph.find_nodes(op="get_attr"):
        value = operator.attrgetter(str(node.target))(gm)
        if not isinstance(value, torch.Tensor) or isinstance(
            value, torch._subclasses.fake_tensor.FakeTensor
        ) or type(value) not in (torch.Tensor, torch.nn.Parameter):
            raise SpmdSerializationError(
                f"graph attribute {node.target!r} is a {type(value).__name__}, not a real tensor"
            )
        attrs[str(node.target)] = value
    return attrs


def dump(gm: fx.GraphModule) -> bytes:
    """``gm`` as bytes (see the module docstring)."""
    nodes = list(gm.graph.nodes)
    positions = {n: i for i, n in enumerate(nodes)}
    rows = [
        (n.op, n.name, n.target, n.args, n.kwargs, n.type,
         {k: v for k, v in n.meta.items() if k.startswith(META_PREFIX)})
        for n in nodes
    ]
    buffer = io.BytesIO()
    try:
        _Pickler(buffer, positions).dump((rows, _attributes(gm)))
    except SpmdSerializationError:
        raise
    except Exception as e:  # noqa: BLE001 - say which node could not travel
        for row in rows:
            try:
                _Pickler(io.BytesIO(), positions).dump(row[2:])
            except Exception:  # noqa: BLE001
                raise SpmdSerializationError(
                    f"node {row[1]} ({row[2]}) cannot be written: {e}"
                ) from e
        raise SpmdSerializationError(f"the graph cannot be written: {e}") from e
    return buffer.getvalue()


def load(data: bytes) -> fx.GraphModule:
    """The graph module :func:`dump` wrote (flat code generation, no example values)."""
    rows, attrs = pickle.loads(data)
    graph = fx.Graph()
    made: list[fx.Node] = []

    def node_of(a: Any) -> Any:
        return made[a] if type(a) is _Ref else a

    for op, name, target, args, kwargs, type_, meta in rows:
        node = graph.create_node(
            op, target, fx.node.map_aggregate(args, node_of),
            fx.node.map_aggregate(kwargs, node_of), name=name, type_expr=type_,
        )
        node.meta.update(meta)
        made.append(node)
    return fx.GraphModule(attrs, graph)


__all__ = ["META_PREFIX", "dump", "load"]
