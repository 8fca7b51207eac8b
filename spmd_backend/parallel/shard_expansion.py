"""Expansion of the sharded-optimizer markers (:mod:`spmd_backend.tracing.sharding`) into
collectives; part of :func:`spmd_backend.parallel.data_parallel.expand_data_parallel`.

Requires: the markers of a trace with ``shard_optimizer=True`` and the last ``grad_ready``
marker of each parameter (not yet expanded). Guarantees:

* ``grad_shard(g, fqn, rank, W)`` whose input is its parameter's last ``grad_ready`` marker,
  read by nothing else, becomes a reduce_scatter: each rank receives only its reduced slice,
  and the marker is consumed (no all_reduce)::

      before:  t_4 -> grad_ready(t_4) -> grad_shard(., rank, W) -> optimizer
      after:   t_4 -> view(-1) -> constant_pad_nd -> reduce_scatter_tensor -> wait -> optimizer

* any other ``grad_shard`` (the full gradient is read elsewhere too: ``clip_grad_norm_``, a
  GradScaler's unscale, a ``.grad`` that outlives the step, a gradient accumulated across calls),
  and every one when the caller does not ``allow_reduce_scatter`` (gloo, where a reduce_scatter
  costs a full all_reduce and two copies; a finite check), becomes a copy of this rank's slice
  of the all-reduced gradient (``view``, ``slice``, then ``clone``, or ``constant_pad_nd`` for
  a last shard that runs past the end), so what the step computes never depends on which path
  was taken;
* with ``gradient_compression`` the reduce_scatter is compressed as DDP's hooks compress an
  all_reduce: cast to the low dtype, divide by W for ``avg``, reduce_scatter with ``sum``, cast
  back (each rank receives exactly its slice of what the compressed all_reduce would give);
  the slice path's all_reduce is compressed by the caller like any other;
* ``param_gather(s, fqn, W)`` becomes ``wait_tensor(all_gather_into_tensor(s, W, group))``
  (parameters travel in their own dtype);
* with ``check_finite_grads`` every gradient keeps its all_reduce (a check on one rank's slice
  could fail on one rank only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from spmd_backend.graph import ops
from spmd_backend.graph.comm import Compression
from spmd_backend.graph.meta import Phase, inherit, owner_of
from spmd_backend.parallel.collectives import add_collective, add_compressed_collective

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


@dataclass(frozen=True)
class ShardExpansion:
    """What :func:`expand_shard_markers` did."""

    reduce_scatters: int
    sliced: int
    all_gathers: int
    #: grad_ready markers the reduce_scatters replaced (the caller must not all_reduce them)
    consumed: frozenset[fx.Node]


def _emit(graph: fx.Graph, target: object, args: tuple, like: fx.Node, phase: Phase) -> fx.Node:
    """``target(*args)`` inserted before ``like`` with its fake value and ``like``'s owner."""
    with graph.inserting_before(like):
        node = graph.call_function(target, args)
    vals = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in args]
    mode = detect_fake_mode(vals)
    if mode is not None:
        with mode:
            node.meta["val"] = target(*vals)
    inherit(node, like, phase=phase)
    return node


def _flat(graph: fx.Graph, grad: fx.Node, like: fx.Node, phase: Phase) -> fx.Node:
    val = grad.meta["val"]
    flatten = aten.view.default if val.is_contiguous() else aten.reshape.default
    return _emit(graph, flatten, (grad, [-1]), like, phase)


def _flat_padded(
    graph: fx.Graph, grad: fx.Node, world: int, chunk: int, like: fx.Node, phase: Phase
) -> fx.Node:
    flat = _flat(graph, grad, like, phase)
    numel = grad.meta["val"].numel()
    if chunk * world == numel:
        return flat
    return _emit(graph, aten.constant_pad_nd.default, (flat, [0, chunk * world - numel], 0.0), like, phase)


def _slice(graph: fx.Graph, grad: fx.Node, rank: int, chunk: int, like: fx.Node) -> fx.Node:
    """This rank's ``chunk`` elements of ``grad`` flattened, a new tensor: a copy of the slice,
    zero-padded where the last shards run past the end (only the slice is copied, never the
    whole padded gradient)."""
    numel = grad.meta["val"].numel()
    start, stop = min(rank * chunk, numel), min((rank + 1) * chunk, numel)
    piece = _emit(graph, aten.slice.Tensor, (_flat(graph, grad, like, Phase.OPTIMIZER), 0, start, stop),
                  like, Phase.OPTIMIZER)
    if stop - start == chunk:
        return _emit(graph, aten.clone.default, (piece,), like, Phase.OPTIMIZER)
    return _emit(graph, aten.constant_pad_nd.default, (piece, [0, chunk - (stop - start)], 0.0),
                 like, Phase.OPTIMIZER)


def _reduce_scatter(graph: fx.Graph, ready: fx.Node, marker: fx.Node, reduce_op: str,
                    group_name: str, compression: Compression | None) -> fx.Node:
    """The reduced shard of ``ready``'s gradient, issued where the gradient became final (as
    its all_reduce would be); returns what replaces ``marker``."""
    _grad, fqn, _rank, world = marker.args
    shard = marker.meta["val"]
    padded = _flat_padded(graph, ready.args[0], world, shard.numel(), ready, Phase.COMM)
    owner = owner_of(str(fqn))
    if compression is not None:
        return add_compressed_collective(
            graph, padded, compression, c10d.reduce_scatter_tensor.default,
            ("sum", world, group_name), name="reduce_scatter", owner=owner, params=[str(fqn)],
            before=ready, out_val=shard,
        )
    wait = add_collective(
        graph, padded, c10d.reduce_scatter_tensor.default, (reduce_op, world, group_name),
        name="reduce_scatter", owner=owner, params=[str(fqn)], before=ready,
    )
    wait.args[0].meta["val"] = wait.meta["val"] = shard
    return wait


def expand_shard_markers(
    graph: fx.Graph,
    last_ready: dict[str, fx.Node],
    *,
    reduce_op: str,
    group_name: str,
    allow_reduce_scatter: bool,
    compression: Compression | None = None,
) -> ShardExpansion:
    """Expand every ``grad_shard``/``param_gather`` marker of ``graph`` (see the module doc)."""
    consumed: set[fx.Node] = set()
    sliced = gathers = 0
    for marker in list(graph.nodes):
        if ops.is_param_gather_marker(marker):
            shard, fqn, world = marker.args
            wait = add_collective(
                graph, shard, c10d.all_gather_into_tensor.default, (world, group_name),
                name="all_gather", owner=owner_of(str(fqn)), params=[str(fqn)], before=marker,
            )
            wait.args[0].meta["val"] = wait.meta["val"] = marker.meta["val"]
            marker.replace_all_uses_with(wait)
            graph.erase_node(marker)
            gathers += 1
            continue
        if not ops.is_grad_shard_marker(marker):
            continue
        grad, fqn, rank, world = marker.args
        ready = last_ready.get(str(fqn))
        chunk = marker.meta["val"].numel()
        if allow_reduce_scatter and grad is ready and set(ready.users) == {marker}:
            out = _reduce_scatter(graph, ready, marker, reduce_op, group_name, compression)
            marker.replace_all_uses_with(out)
            graph.erase_node(marker)
            consumed.add(ready)
            continue
        copy = _slice(graph, grad, rank, chunk, marker)
        marker.replace_all_uses_with(copy)
        graph.erase_node(marker)
        sliced += 1
    return ShardExpansion(len(consumed), sliced, gathers, frozenset(consumed))
