"""Insert one functional collective and its ``wait_tensor`` into a graph, annotated.

The one builder every expansion uses (:mod:`spmd_backend.parallel.data_parallel`,
:mod:`spmd_backend.parallel.shard_expansion`) and bucketing reuses for compression. Guarantees:
both nodes carry the input's fake value (callers whose collective changes the shape overwrite
it) and the ``comm`` phase with the owning module's FQN; a gradient collective records the
parameters it carries. :func:`add_compressed_all_reduce` (and :func:`add_compressed_collective` for the sharded
reduce_scatter) wraps the collective in DDP's
compression-hook casts (cast, pre-divide, sum, cast back), all in the ``comm`` phase, and records
the :class:`~spmd_backend.graph.comm.Compression` on the collective.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from spmd_backend.graph.comm import Compression
from spmd_backend.graph.meta import BUCKET_PARAMS_KEY, COMPRESSION_KEY, Phase, annotate
from spmd_backend.graph.utils import fake_mode_of, propagate_val

c10d = torch.ops._c10d_functional
aten = torch.ops.aten
convert = torch.ops.prims.convert_element_type.default


def add_collective(
    graph: fx.Graph,
    value: fx.Node,
    target: object,
    args: tuple,
    *,
    name: str,
    owner: str | None,
    params: list[str] | None = None,
    before: fx.Node | None = None,
) -> fx.Node:
    """Insert ``wait_tensor(target(value, *args))`` (after ``value``, or before ``before``);
    returns the wait. Both nodes get ``value``'s fake value and the ``comm`` phase; a gradient
    all_reduce also records the parameters it carries (``spmd_bucket_params``)."""
    where = graph.inserting_before(before) if before is not None else graph.inserting_after(value)
    with where:
        comm = graph.create_node("call_function", target, (value, *args), name=name)
    with graph.inserting_after(comm):
        wait = graph.create_node("call_function", c10d.wait_tensor.default, (comm,), name="wait_tensor")
    for node in (comm, wait):
        if "val" in value.meta:
            node.meta["val"] = value.meta["val"]
        annotate(node, fqn=owner, phase=Phase.COMM)
    if params is not None:
        comm.meta[BUCKET_PARAMS_KEY] = list(params)
    return wait


def compress(graph: fx.Graph, value: fx.Node, compression: Compression, owner: str | None,
             *, before: fx.Node | None = None) -> fx.Node:
    """``value`` cast to the compression dtype and pre-divided (after ``value``, or before
    ``before``)."""
    fake_mode = fake_mode_of(graph)
    where = graph.inserting_before(before) if before is not None else graph.inserting_after(value)
    with where:
        out = graph.call_function(convert, (value, compression.dtype))
    nodes = [out]
    if compression.divisor is not None:
        with graph.inserting_after(out):
            out = graph.call_function(aten.div.Tensor, (out, compression.divisor))
        nodes.append(out)
    for node in nodes:
        annotate(node, fqn=owner, phase=Phase.COMM)
        propagate_val(node, fake_mode)
    return out


def decompress(graph: fx.Graph, wait: fx.Node, dtype: torch.dtype, owner: str | None) -> fx.Node:
    """``wait`` cast back to the gradient's ``dtype``, inserted after it."""
    with graph.inserting_after(wait):
        back = graph.call_function(convert, (wait, dtype))
    annotate(back, fqn=owner, phase=Phase.COMM)
    propagate_val(back, fake_mode_of(graph))
    return back


def add_compressed_collective(
    graph: fx.Graph, value: fx.Node, compression: Compression, target: object, args: tuple, *,
    name: str, owner: str | None, params: list[str], before: fx.Node,
    out_val: torch.Tensor | None = None,
) -> fx.Node:
    """``cast back(wait(target(compress(value), *args)))`` before ``before`` (``args`` name the
    ``sum`` reduction); returns the cast back. ``out_val``: the collective's result in
    ``value``'s dtype when its shape differs from ``value``'s (a reduce_scatter's shard)."""
    packed = compress(graph, value, compression, owner, before=before)
    wait = add_collective(graph, packed, target, args, name=name, owner=owner, params=params)
    if out_val is not None:
        wait.args[0].meta["val"] = wait.meta["val"] = out_val.to(compression.dtype)
    wait.args[0].meta[COMPRESSION_KEY] = compression
    return decompress(graph, wait, value.meta["val"].dtype, owner)


def add_compressed_all_reduce(
    graph: fx.Graph, value: fx.Node, compression: Compression, group_name: str, *,
    owner: str | None, params: list[str], before: fx.Node,
) -> fx.Node:
    """``cast back(wait(all_reduce(compress(value), "sum")))`` before ``before``; returns the
    cast back."""
    return add_compressed_collective(
        graph, value, compression, c10d.all_reduce.default, ("sum", group_name),
        name="all_reduce", owner=owner, params=params, before=before,
    )
