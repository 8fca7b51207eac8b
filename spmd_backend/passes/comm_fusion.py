"""comm_fusion_with_concat: bucket gradient all_reduces the way DDP does.

Requires: a graph whose gradient all_reduces are single-gradient blocks (data-parallel
expansion output), with ``meta["val"]`` on the gradients. Guarantees: gradients are grouped
greedily in readiness order (graph order) into buckets; per (group, op, dtype, device) the first
bucket closes once it holds >= 1 MiB, later ones once they hold >= ``bucket_size_mb`` MiB (bytes from each gradient's real
dtype and shape); a bucket never mixes process groups, reduce ops, dtypes or devices. Each
bucket becomes flatten -> cat -> one all_reduce -> wait -> split -> a view per gradient, placed
where its last gradient becomes ready, so the relative order of collectives is kept (a bucket
closes early where a member's reduced gradient is read before the next gradient exists: SAM
reads the first backward's gradients before its second backward). New nodes
are named by fx (``all_reduce_default``, ``all_reduce_default_1``, ...), carry ``meta["val"]``,
the ``comm`` phase and ``meta["spmd_bucket_params"]`` (the parameter FQNs they carry).
Compressed collectives (``DataParallel(gradient_compression=...)``: cast, pre-divide, sum, cast
back) are bucketed with their kind only, and the bucket is compressed as a whole: flatten -> cat
-> cast -> divide -> all_reduce -> wait -> cast back -> split (elementwise, so the numerics are
those of one gradient at a time, as in DDP's hook on its own buckets).
Sharded optimizer state (``DataParallel(shard_optimizer=True)``): per-parameter reduce_scatters
and all_gathers are bucketed the same way (by kind, group, op, world size and dtype; the size is
the full gradient's or parameter's). A bucket lays the flat, padded tensors out rank-major, so
each rank's slices are contiguous and one collective moves them all::

    reduce_scatter:  g_i [W*c_i] -> view [W, c_i] -> cat(dim 1) [W, C] -> view -> reduce_scatter
                     -> wait [C] -> split(c_i) -> this rank's shard of each gradient
    all_gather:      s_i [c_i] -> cat [C] -> all_gather -> wait [W*C] -> view [W, C]
                     -> split(c_i, dim 1) -> reshape [W*c_i] (each parameter's gathered shards)

A reduce_scatter bucket is placed where its last gradient becomes ready; an all_gather bucket
right after its last updated shard, and only where every parameter copy that reads it comes
later (else its members stay apart, logged). ``shard_buckets`` chooses; by default (None) every
process group but gloo's buckets them: on gloo one bucketed reduce_scatter + all_gather pair
measured slower than per-parameter ones (docs/benchmarks.md), while NCCL's per-collective
latency is what bucketing exists for.
Large gradients on the CPU stay alone (``standalone_mb``; the default pipeline's is
:data:`CPU_STANDALONE_MB`): an uncompressed gradient all_reduce of at least that size is left
as the expansion made it, one collective on the gradient as the backward produced it, which
Inductor runs in place in the producing kernel's own buffer (a matmul's output), instead of
copying it into a bucket and back out, memory traffic that competes with the compute for the
same cores. The price is one more collective's fixed cost (about 1.5 ms per gloo loopback
all_reduce on 2 cores, the time to copy 4-6 MiB there). For ``avg`` the expansion takes the
mean after the sum where that is bit-identical (power-of-two worlds), so nothing stands between
such a gradient and its collective. On accelerators a copy costs far less than a collective's
launch, so large gradients are bucketed there as before.
An absent pattern (no unfused gradient collective) is a logged no-op.

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
import torch.distributed as dist
import torch.fx as fx

from spmd_backend.graph import ops
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

#: CPU gradients at least this large (MiB) are reduced alone, in place (the default pipeline's
#: ``standalone_mb``; see the module docstring)
CPU_STANDALONE_MB = 4.0


@dataclass(frozen=True)
class Bucket:
    """One planned bucket: the blocks it fuses and their total size."""

    blocks: tuple[CommBlock, ...]
    nbytes: int
    group: str
    reduce_op: str | None
    dtype: torch.dtype
    compression: Compression | None = None
    #: "all_reduce", "reduce_scatter" or "all_gather"
    kind: str = "all_reduce"
    #: the world size of a reduce_scatter/all_gather bucket
    world: int | None = None


#: sharded-optimizer collectives (one parameter each before bucketing)
SHARD_KINDS = {
    c10d.reduce_scatter_tensor.default: "reduce_scatter",
    c10d.all_gather_into_tensor.default: "all_gather",
}


def _grad(block: CommBlock) -> fx.Node:
    """The gradient a single-gradient block reduces (before any compression cast)."""
    return block.inputs[0]


def _compression(block: CommBlock) -> Compression | None:
    return block.comm_node.meta.get(COMPRESSION_KEY)


def _bucket_key(block: CommBlock) -> tuple[tuple, int] | None:
    """(what must be equal to share a bucket, the bytes the block adds) for an unfused block;
    None for anything else."""
    node = block.comm_node
    kind = SHARD_KINDS.get(node.target) if node.op == "call_function" else None  # type: ignore[call-overload]
    if kind is None:
        val = _grad(block).meta.get("val") if block.unfused and ops.is_all_reduce(node) else None
        if not isinstance(val, torch.Tensor):
            return None
        key = ("all_reduce", block.group, block.reduce_op, None, val.dtype, val.device,
               _compression(block))
        return key, tensor_nbytes(val)
    if len(bucket_params(node)) != 1:
        return None  # fused already
    full = node.args[0].meta.get("val") if kind == "reduce_scatter" else block.wait_node.meta.get("val")
    if not isinstance(full, torch.Tensor):
        return None
    op, world = (node.args[1], node.args[2]) if kind == "reduce_scatter" else (None, node.args[1])
    return (kind, block.group, op, world, full.dtype, full.device, None), tensor_nbytes(full)


def _bucket(members: list[CommBlock], nbytes: int, key: tuple) -> Bucket:
    kind, group, reduce_op, world, dtype, _, compression = key
    return Bucket(tuple(members), nbytes, group, reduce_op, dtype, compression, kind, world)


def shard_bucketing(group: str, choice: bool | None = None) -> bool:
    """Whether reduce_scatters/all_gathers on ``group`` are bucketed (see the module doc)."""
    if choice is not None:
        return choice
    try:
        pg = dist.distributed_c10d._resolve_process_group(group)
    except (RuntimeError, ValueError):
        return True
    return dist.get_backend(pg) != "gloo"


def standalone(key: tuple, nbytes: int, standalone_mb: float | None) -> bool:
    """Whether an unfused gradient all_reduce stays alone (see the module docstring): an
    uncompressed gradient on the CPU of at least ``standalone_mb`` MiB."""
    kind, _, _, _, _, device, compression = key
    return (standalone_mb is not None and kind == "all_reduce" and compression is None
            and device.type == "cpu" and nbytes >= standalone_mb * 1024 * 1024)


def plan_buckets(graph: fx.Graph, bucket_size_mb: float, shard_buckets: bool | None = None,
                 standalone_mb: float | None = None) -> list[Bucket]:
    """The buckets :func:`comm_fusion_with_concat` would build (analysis only)."""
    cap = int(bucket_size_mb * 1024 * 1024)
    open_buckets: dict[tuple, list[CommBlock]] = {}
    sizes: dict[tuple, int] = {}
    planned: list[Bucket] = []
    closed: set[tuple] = set()  # keys whose first (1 MiB) bucket is closed, as in DDP
    alone = 0
    order = node_order(graph)
    #: per open bucket: where the first reader of any member's reduced gradient stands
    first_read: dict[tuple, int] = {}
    for block in get_all_comm_blocks(graph, ops.is_collective):
        keyed = _bucket_key(block)
        if keyed is not None and standalone(*keyed, standalone_mb):
            alone += 1
            continue
        if keyed is None:
            continue
        key, nbytes = keyed
        members = open_buckets.setdefault(key, [])
        if members and key[0] != "all_gather" \
                and first_read.get(key, len(order)) < order[block.comm_node]:
            # a member's reduced gradient is read before this gradient exists (SAM reads the
            # first backward's gradients before the second backward): the bucket, placed at
            # its last member's collective, must end before that reader (an all_gather bucket
            # is placed after its last shard instead, and checked by _shard_anchor)
            planned.append(_bucket(members, sizes[key], key))
            members = open_buckets[key] = []
            sizes[key] = 0
            first_read.pop(key, None)
        members.append(block)
        readers = [order[u] for o in block.outputs for u in o.users if u in order]
        if readers:
            first_read[key] = min(first_read.get(key, len(order)), *readers)
        sizes[key] = sizes.get(key, 0) + nbytes
        limit = cap if key in closed else FIRST_BUCKET_BYTES
        if sizes[key] >= limit:
            closed.add(key)
            planned.append(_bucket(members, sizes[key], key))
            open_buckets[key] = []
            sizes[key] = 0
            first_read.pop(key, None)
    for key, members in open_buckets.items():
        if members:
            planned.append(_bucket(members, sizes[key], key))
    # a shard collective alone in its bucket is already what fusing it would make
    planned = [b for b in planned if b.kind == "all_reduce" or (
        len(b.blocks) > 1 and shard_bucketing(b.group, shard_buckets))]
    if alone:
        log.debug("plan_buckets: %d gradients of >= %s MiB stay alone (reduced in place)",
                  alone, standalone_mb)
    return sorted(planned, key=lambda b: order[b.blocks[-1].comm_node])


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
    emit = _emitter(graph, fqn, fake_mode)

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


def _emitter(graph: fx.Graph, fqn: str | None, fake_mode: object):  # noqa: ANN202
    def emit(target: object, args: tuple, val: torch.Tensor | None = None) -> fx.Node:
        node = graph.call_function(target, args)
        annotate(node, fqn=fqn, phase=Phase.COMM)
        if val is None:
            propagate_val(node, fake_mode)
        else:
            node.meta["val"] = val
        return node

    return emit


def _shard_anchor(graph: fx.Graph, bucket: Bucket) -> fx.Node | None:
    """Where a shard bucket's collective goes: before its last member's collective for a
    reduce_scatter, right after its last updated shard for an all_gather; None when something
    reads a member's result before that (the bucket cannot be formed)."""
    blocks = bucket.blocks
    order = node_order(graph)
    if bucket.kind == "reduce_scatter":
        anchor = blocks[-1].comm_node
    else:
        anchor = max((b.comm_node.args[0] for b in blocks), key=order.__getitem__).next
    members = {n for b in blocks for n in b.node_list}
    readers = [u for b in blocks for out in b.outputs for u in out.users if u not in members]
    if any(order[u] < order[anchor] for u in readers):
        return None
    return anchor


def _fuse_shard(graph: fx.Graph, bucket: Bucket, fake_mode: object) -> fx.Node | None:
    """One reduce_scatter or all_gather for the bucket's parameters, rank-major (see the module
    docstring); None when the bucket cannot be formed."""
    anchor = _shard_anchor(graph, bucket)
    if anchor is None:
        return None
    blocks, world = bucket.blocks, int(bucket.world or 1)
    params = [p for b in blocks for p in bucket_params(b.comm_node)]
    emit = _emitter(graph, _common_prefix([owner_of(p) for p in params]), fake_mode)
    chunks = [b.wait_node.meta["val"].numel() // (world if bucket.kind == "all_gather" else 1)
              for b in blocks]
    total = sum(chunks)
    with graph.inserting_before(anchor):
        if bucket.kind == "reduce_scatter":
            rows = [emit(aten.view.default, (b.comm_node.args[0], [world, c]))
                    for b, c in zip(blocks, chunks)]
            packed = emit(aten.view.default, (emit(aten.cat.default, (rows, 1)), [-1]))
            comm = emit(c10d.reduce_scatter_tensor.default,
                        (packed, bucket.reduce_op, world, bucket.group), packed.meta["val"].new_empty(total))
        else:
            packed = emit(aten.cat.default, ([b.comm_node.args[0] for b in blocks],))
            comm = emit(c10d.all_gather_into_tensor.default, (packed, world, bucket.group),
                        packed.meta["val"].new_empty(world * total))
        comm.meta[BUCKET_PARAMS_KEY] = params
        wait = emit(c10d.wait_tensor.default, (comm,), comm.meta["val"])
        if bucket.kind == "reduce_scatter":
            split = emit(aten.split_with_sizes.default, (wait, chunks))
            pieces = [emit(operator.getitem, (split, i)) for i in range(len(blocks))]
        else:
            split = emit(aten.split_with_sizes.default,
                         (emit(aten.view.default, (wait, [world, total])), chunks, 1))
            pieces = [emit(aten.reshape.default, (emit(operator.getitem, (split, i)), [-1]))
                      for i in range(len(blocks))]
    for b, piece in zip(blocks, pieces):
        b.wait_node.replace_all_uses_with(piece)
        graph.erase_node(b.wait_node)
        graph.erase_node(b.comm_node)
        for node in b.tail_nodes:  # a compressed gradient's cast back: after its piece
            piece.append(node)
            piece = node
    return comm


def comm_fusion_with_concat(gm: object, bucket_size_mb: float = 25,
                            shard_buckets: bool | None = None,
                            standalone_mb: float | None = None) -> None:
    """Bucket gradient collectives (see the module docstring)."""
    graph: fx.Graph = gm.graph  # type: ignore[attr-defined]
    buckets = plan_buckets(graph, bucket_size_mb, shard_buckets, standalone_mb)
    if not buckets:
        log.info("comm_fusion_with_concat: no unfused gradient collective; nothing to do")
        return
    fake_mode = fake_mode_of(graph)
    fused: dict[str, list[int]] = {}
    for bucket in buckets:
        comm = _fuse(graph, bucket, fake_mode) if bucket.kind == "all_reduce" else (
            _fuse_shard(graph, bucket, fake_mode))
        if comm is None:
            log.info("comm_fusion_with_concat: %d %ss stay apart (a parameter copy reads one "
                     "before the last shard is updated)", len(bucket.blocks), bucket.kind)
            continue
        fused.setdefault(bucket.kind, [0, 0])
        fused[bucket.kind][0] += len(bucket.blocks)
        fused[bucket.kind][1] += 1
        log.debug(
            "bucket %s: %d gradients, %.2f MiB, %s", comm.name, len(bucket.blocks),
            bucket.nbytes / 2**20, bucket.reduce_op,
        )
    log.info("comm_fusion_with_concat: %s", ", ".join(
        f"{n} {kind}s -> {k} buckets" for kind, (n, k) in fused.items()) or "nothing fused")


declare_pass(comm_fusion_with_concat)
