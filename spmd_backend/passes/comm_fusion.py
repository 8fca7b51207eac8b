"""comm_fusion_with_concat: bucket gradient all_reduces the way DDP does.

Requires: a graph whose gradient all_reduces are single-gradient blocks (data-parallel
expansion output), with ``meta["val"]`` on the gradients. Guarantees: gradients are grouped
greedily in readiness order (graph order) into buckets; per (group, op, dtype, device) the first
bucket closes once it holds >= 1 MiB, later ones once they hold >= ``bucket_size_mb`` MiB (bytes from each gradient's real
dtype and shape); a bucket never mixes process groups, reduce ops, dtypes or devices. Each
bucket becomes flatten -> cat -> one all_reduce -> wait -> split -> a view per gradient, placed
where its last gradient becomes ready, so the relative order of collectives is kept. New nodes
are named by fx (``all_reduce_default``, ``all_reduce_default_1``, ...), carry ``meta["val"]``,
the ``comm`` phase and ``meta["spmd_bucket_params"]`` (the parameter FQNs they carry).
Compressed collectives (``DataParallel(gradient_compression=...)``: cast, pre-divide, sum, cast
back) are bucketed with their kind only, and the bucket is compressed as a whole: flatten -> cat
-> cast -> divide -> all_reduce -> wait -> cast back -> split (elementwise, so the numerics are
those of one gradient at a time, as in DDP's hook on its own buckets).
An absent pattern (no unfused gradient all_reduce) is a logged no-op.

::

    before:  g1 -> all_reduce -> wait -> opt      g2 -> all_reduce_1 -> wait_1 -> opt
    after:   g1 -> view ┐
             g2 -> view ┴ cat -> all_reduce_default -> wait -> split -> view -> opt
                                                                     └-> view -> opt
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from spmd_backend.graph.comm import CommBlock, Compression, get_all_comm_blocks
from spmd_backend.graph.meta import (
    BUCKET_PARAMS_KEY,
    COMPRESSION_KEY,
    Phase,
    annotate,
    bucket_params,
    owner_of,
)
from spmd_backend.graph.utils import fake_mode_of, node_order, propagate_val, tensor_nbytes
from spmd_backend.parallel.collectives import compress, decompress
from spmd_backend.pass_manager import declare_pass

log = logging.getLogger(__name__)
aten = torch.ops.aten
c10d = torch.ops._c10d_functional

#: DDP's first bucket is small so that communication starts early
FIRST_BUCKET_BYTES = 1024 * 1024


@dataclass(frozen=True)
class Bucket:
    """One planned bucket: the blocks it fuses and their total size."""

    blocks: tuple[CommBlock, ...]
    nbytes: int
    group: str
    reduce_op: str
    dtype: torch.dtype
    compression: Compression | None = None


def _grad(block: CommBlock) -> fx.Node:
    """The gradient a single-gradient block reduces (before any compression cast)."""
    return block.inputs[0]


def _compression(block: CommBlock) -> Compression | None:
    return block.comm_node.meta.get(COMPRESSION_KEY)


def plan_buckets(graph: fx.Graph, bucket_size_mb: float) -> list[Bucket]:
    """The buckets :func:`comm_fusion_with_concat` would build (analysis only)."""
    cap = int(bucket_size_mb * 1024 * 1024)
    open_buckets: dict[tuple, list[CommBlock]] = {}
    sizes: dict[tuple, int] = {}
    planned: list[tuple[int, Bucket]] = []
    closed: set[tuple] = set()  # keys whose first (1 MiB) bucket is closed, as in DDP
    for block in get_all_comm_blocks(graph):
        if not block.unfused:
            continue  # already fused
        val = _grad(block).meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        key = (block.group, block.reduce_op, val.dtype, val.device, _compression(block))
        members = open_buckets.setdefault(key, [])
        members.append(block)
        sizes[key] = sizes.get(key, 0) + tensor_nbytes(val)
        limit = cap if key in closed else FIRST_BUCKET_BYTES
        if sizes[key] >= limit:
            closed.add(key)
            planned.append((len(planned), Bucket(tuple(members), sizes[key], *_kind(key))))
            open_buckets[key] = []
            sizes[key] = 0
    for key, members in open_buckets.items():
        if members:
            planned.append((len(planned), Bucket(tuple(members), sizes[key], *_kind(key))))
    order = node_order(graph)
    return [b for _, b in sorted(planned, key=lambda ib: order[ib[1].blocks[-1].comm_node])]


def _kind(key: tuple) -> tuple:
    group, reduce_op, dtype, _, compression = key
    return group, reduce_op, dtype, compression


def _common_prefix(fqns: list[str]) -> str | None:
    if not fqns:
        return None
    parts = [f.split(".") for f in fqns]
    prefix: list[str] = []
    for items in zip(*parts):
        if len(set(items)) != 1:
            break
        prefix.append(items[0])
    return ".".join(prefix)


def _fuse(graph: fx.Graph, bucket: Bucket, fake_mode: object) -> fx.Node:
    blocks = bucket.blocks
    params = [p for b in blocks for p in bucket_params(b.comm_node)]
    fqn = _common_prefix([owner_of(p) for p in params])
    new_nodes: list[fx.Node] = []

    def emit(target: object, args: tuple) -> fx.Node:
        node = graph.call_function(target, args)
        new_nodes.append(node)
        annotate(node, fqn=fqn, phase=Phase.COMM)
        propagate_val(node, fake_mode)
        return node

    last = blocks[-1].comm_node
    with graph.inserting_before(last):
        flats = []
        for b in blocks:
            g = _grad(b)
            val = g.meta["val"]
            flat_op = aten.view.default if val.is_contiguous() else aten.reshape.default
            flats.append(emit(flat_op, (g, [-1])))
        packed = emit(aten.cat.default, (flats,)) if len(flats) > 1 else flats[0]
        if bucket.compression is not None:
            packed = compress(graph, packed, bucket.compression, fqn)
        comm = emit(c10d.all_reduce.default, (packed, bucket.reduce_op, bucket.group))
        comm.meta[BUCKET_PARAMS_KEY] = params
        if bucket.compression is not None:
            comm.meta[COMPRESSION_KEY] = bucket.compression
        wait = emit(c10d.wait_tensor.default, (comm,))
        if bucket.compression is not None:
            wait = decompress(graph, wait, bucket.dtype, fqn)
        sizes = [_grad(b).meta["val"].numel() for b in blocks]
        if len(blocks) > 1:
            split = emit(aten.split_with_sizes.default, (wait, sizes))
            pieces = [emit(operator.getitem, (split, i)) for i in range(len(blocks))]
        else:
            pieces = [wait]
        for b, piece in zip(blocks, pieces):
            shape = list(_grad(b).meta["val"].shape)
            view = emit(aten.view.default, (piece, shape))
            b.outputs[0].replace_all_uses_with(view)
    for b in blocks:
        for node in reversed(b.node_list):
            graph.erase_node(node)
    return comm


def comm_fusion_with_concat(gm: object, bucket_size_mb: float = 25) -> None:
    """Bucket gradient all_reduces (see the module docstring)."""
    graph: fx.Graph = gm.graph  # type: ignore[attr-defined]
    buckets = plan_buckets(graph, bucket_size_mb)
    if not buckets:
        log.info("comm_fusion_with_concat: no unfused gradient all_reduce; nothing to do")
        return
    fake_mode = fake_mode_of(graph)
    for bucket in buckets:
        comm = _fuse(graph, bucket, fake_mode)
        log.debug(
            "bucket %s: %d gradients, %.2f MiB, %s", comm.name, len(bucket.blocks),
            bucket.nbytes / 2**20, bucket.reduce_op,
        )
    log.info(
        "comm_fusion_with_concat: %d all_reduces -> %d buckets",
        sum(len(b.blocks) for b in buckets), len(buckets),
    )


declare_pass(comm_fusion_with_concat)
