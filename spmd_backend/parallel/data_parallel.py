"""Data-parallel expansion: gradient all_reduce and buffer broadcast inserted into the graph.

Requires a graph from :func:`spmd_backend.tracing.trace.trace_train_step` (``grad_ready`` and,
optionally, ``buffer_sync`` markers) and an initialized default process group. Guarantees:

* every ``grad_ready(g, fqn)`` marker is replaced, at the same position (where the gradient
  became final in the backward), by ``wait_tensor(all_reduce(g, "sum", group))``; for ``avg``
  the mean is DDP's arithmetic bit for bit: ``g * (1 / world)`` before the sum, or, where that
  is the same number (:func:`scales_after_sum`: a power-of-two world, fp32/fp64/bf16), the sum
  times ``1 / world`` just before the gradient's first reader; a parameter
  whose gradient is accumulated over several backward calls is reduced once, at its last
  accumulation, unless the step reads an intermediate gradient (SAM): that one is reduced
  where it stands and later contributions are reduced alone (:func:`_reduce_chain`).
  Parameters without a gradient get no collective (DDP with ``find_unused_parameters`` leaves
  them untouched as well);
* every ``grad_contribution(g, fqn)`` marker (a contribution added to a ``.grad`` that an
  earlier call already reduced) becomes ``wait_tensor(all_reduce(g, op, group))`` of its own:
  only new contributions are reduced, so accumulation across calls under ``sum`` never
  multiplies earlier micro-batches by the world size again;
* the ``buffer_sync(b, fqn)`` markers become broadcasts from the group's first rank, one per
  dtype and device of the buffers (DDP's coalesced ``broadcast_buffers``; see
  :mod:`spmd_backend.parallel.buffer_broadcast`);
* ``grad_shard``/``param_gather`` markers (``shard_optimizer=True``) become reduce_scatters (or
  slices of the all-reduced gradient: where the full gradient is read elsewhere, and every one
  on gloo unless ``reduce_scatter_grads=True``) and all_gathers, see
  :mod:`spmd_backend.parallel.shard_expansion`;
* new nodes carry ``meta["val"]`` and the ``comm`` phase with the owning module's FQN.

Sketch for one parameter ``w``::

    before:  mm_3 -> t_4 -> grad_ready(t_4, "fc.weight") -> optimizer
    after:   mm_3 -> t_4 -> all_reduce(t_4, "sum", g) -> wait_tensor -> optimizer
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx as fx

from spmd_backend.errors import SpmdDistributedError, SpmdUsageError
from spmd_backend.graph import ops
from spmd_backend.graph.comm import Compression
from spmd_backend.graph.meta import BUCKET_PARAMS_KEY, Phase, annotate, inherit, owner_of
from spmd_backend.graph.utils import fake_mode_of, node_order, propagate_val
from spmd_backend.parallel.buffer_broadcast import expand_buffer_broadcasts
from spmd_backend.parallel.collectives import add_collective, add_compressed_all_reduce
from spmd_backend.parallel.gloo_all_gather import backend_is_gloo
from spmd_backend.parallel.shard_expansion import expand_shard_markers
from spmd_backend.tracing.markers import GRAD_CONTRIBUTION

log = logging.getLogger(__name__)

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
_REDUCE_OPS = ("sum", "avg")
_COMPRESSION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class DataParallel:
    """Data-parallel semantics of a compiled step.

    ``reduce_op``: ``"sum"`` (default; compiled gradients are ``world_size`` times DDP's mean)
    or ``"avg"`` (DDP's mean). ``group``: ``None`` for the default (WORLD) group, a
    ``ProcessGroup``, or a 1-D ``DeviceMesh``. ``broadcast_buffers``: broadcast module buffers
    from the group's first rank at the start of every step, as DDP does by default.
    ``sync_module_states``: broadcast parameters and buffers from the group's first rank before
    the first step, as DDP's constructor does. ``check_finite_grads``: fail the step (on every
    rank, before the optimizer touches anything) when a reduced gradient holds NaN or Inf.
    ``check_consistency``: before a new graph's first collective, compare its collective schedule
    with every rank's through the store (``consistency_timeout_s``), see
    :mod:`spmd_backend.parallel.consistency`, and refuse a graph whose parameter or optimizer
    state update depends on a rank's own batch without a collective (the replicas would drift
    apart), see :mod:`spmd_backend.parallel.replicas`. ``shard_optimizer``: ZeRO-style sharded optimizer
    state: each rank keeps and updates only its 1/world share of every parameter's optimizer
    state (gradients reduce_scattered, updated parameters all_gathered), see
    :mod:`spmd_backend.tracing.sharding` and :mod:`spmd_backend.parallel.sharded_state`.
    ``gradient_compression``: ``"bf16"`` or ``"fp16"`` to all_reduce gradients in that precision
    with the semantics of DDP's ``bf16_compress_hook``/``fp16_compress_hook`` (cast, divide by
    the world size for ``avg``, sum, cast back; with ``shard_optimizer`` the reduce_scatter is
    compressed the same way); ``None`` (default) reduces in the gradients' own dtype.
    ``reduce_scatter_grads`` (with ``shard_optimizer``): how each rank gets its reduced gradient
    shard: ``True`` a reduce_scatter, ``False`` an all_reduce of the whole gradient and a slice
    of it (the same numbers); ``None`` (default) chooses by the process group: a reduce_scatter,
    except on gloo, which runs one as a copy of the input, an all_reduce of all of it and a copy
    of the chunk, so the all_reduce alone, in place on the gradient, costs strictly less
    (:func:`reduce_scatter_is_native`).
    """

    reduce_op: str = "sum"
    group: object = None
    broadcast_buffers: bool = True
    sync_module_states: bool = True
    check_finite_grads: bool = False
    check_consistency: bool = True
    consistency_timeout_s: float = 300.0
    shard_optimizer: bool = False
    gradient_compression: str | None = None
    reduce_scatter_grads: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.shard_optimizer, bool):
            raise SpmdUsageError(
                f"DataParallel(shard_optimizer={self.shard_optimizer!r}): expected True or False"
            )
        if self.reduce_scatter_grads not in (None, True, False):
            raise SpmdUsageError(
                f"DataParallel(reduce_scatter_grads={self.reduce_scatter_grads!r}): expected "
                "None (by process group), True or False"
            )
        if self.reduce_scatter_grads is not None and not self.shard_optimizer:
            raise SpmdUsageError(
                f"DataParallel(reduce_scatter_grads={self.reduce_scatter_grads!r}) chooses how "
                "sharded optimizer state gets its gradient shards; it needs shard_optimizer=True"
            )
        if self.reduce_scatter_grads and self.check_finite_grads:
            raise SpmdUsageError(
                "DataParallel(reduce_scatter_grads=True, check_finite_grads=True): the finite "
                "check reads every full reduced gradient, which only the all_reduce path has; "
                "leave reduce_scatter_grads=None"
            )
        timeout = self.consistency_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise SpmdUsageError(
                f"DataParallel(consistency_timeout_s={timeout!r}): expected a positive number "
                "of seconds"
            )
        if self.reduce_op not in _REDUCE_OPS:
            raise SpmdUsageError(
                f"DataParallel(reduce_op={self.reduce_op!r}): expected one of {_REDUCE_OPS}"
            )
        if self.gradient_compression is not None:
            if self.gradient_compression not in _COMPRESSION_DTYPES:
                raise SpmdUsageError(
                    f"DataParallel(gradient_compression={self.gradient_compression!r}): expected "
                    f"None or one of {sorted(_COMPRESSION_DTYPES)}"
                )

    def compression(self, world: int) -> Compression | None:
        """The gradient all_reduce's :class:`Compression` on a group of ``world`` ranks
        (``None``: uncompressed)."""
        if self.gradient_compression is None:
            return None
        divisor = world if self.reduce_op == "avg" else None
        return Compression(_COMPRESSION_DTYPES[self.gradient_compression], divisor)

    def reduce_scatters(self, device: torch.device) -> bool:
        """Whether a sharded gradient of ``device`` is reduce_scattered (else all-reduced and
        sliced); see ``reduce_scatter_grads``. A finite check needs every full gradient (and
        refuses ``reduce_scatter_grads=True``)."""
        if self.check_finite_grads:
            return False
        if self.reduce_scatter_grads is not None:
            return self.reduce_scatter_grads
        return reduce_scatter_is_native(self.process_group(), device)

    def process_group(self) -> dist.ProcessGroup:
        """The process group collectives run on (checked to exist)."""
        if not dist.is_available() or not dist.is_initialized():
            raise SpmdDistributedError(
                "spmd_backend: data-parallel compilation needs an initialized process group; "
                "call torch.distributed.init_process_group() first (torchrun sets the "
                "environment it needs)"
            )
        group = self.group
        if group is None:
            return dist.group.WORLD  # type: ignore[return-value]
        if isinstance(group, dist.ProcessGroup):
            return group
        mesh_cls = getattr(getattr(dist, "device_mesh", None), "DeviceMesh", None)
        if mesh_cls is not None and isinstance(group, mesh_cls):
            if group.ndim != 1:
                raise SpmdUsageError(
                    f"DataParallel(group=DeviceMesh): a 1-D mesh is required, got {group.ndim}-D"
                )
            return group.get_group()
        raise SpmdUsageError(
            "DataParallel(group=...): expected None, a torch.distributed.ProcessGroup or a "
            f"1-D DeviceMesh, got {type(group).__qualname__}"
        )

    def group_name(self) -> str:
        return self.process_group().group_name

    def src_rank(self) -> int:
        """Global rank of the group's first member (source of broadcasts)."""
        pg = self.process_group()
        return dist.get_global_rank(pg, 0) if pg is not dist.group.WORLD else 0


def reduce_scatter_is_native(pg: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether ``pg`` runs a reduce_scatter of ``device`` tensors as one collective. gloo does
    not: it clones the input, all_reduces the whole clone and copies this rank's chunk out
    (measured on 2 loopback ranks, the DummyModel's gradients: 101-137 ms against 66 ms for the
    in-place all_reduce of the same tensors, docs/benchmarks.md)."""
    return not backend_is_gloo(pg, device)


@dataclass(frozen=True)
class ExpansionReport:
    """What :func:`expand_data_parallel` inserted."""

    all_reduces: int
    broadcasts: int
    merged_markers: int
    group_name: str
    reduce_op: str
    reduce_scatters: int = 0
    all_gathers: int = 0


def _expand_marker(graph: fx.Graph, marker: fx.Node, target: object, args: tuple, name: str) -> fx.Node:
    fqn = str(marker.args[1])
    wait = add_collective(
        graph, marker.args[0], target, args, name=name, owner=owner_of(fqn),
        params=[fqn] if target is c10d.all_reduce.default else None, before=marker,
    )
    marker.replace_all_uses_with(wait)
    graph.erase_node(marker)
    return wait


#: dtypes whose sum of ``world`` gradients cannot overflow where the sum of their scaled values
#: would not (fp16's range is small enough that it can: it is always scaled first)
_POSTSCALE_DTYPES = frozenset({torch.float32, torch.float64, torch.bfloat16})


def scales_after_sum(world: int, dtype: torch.dtype) -> bool:
    """Whether DDP's mean can be taken after the sum, bit for bit: multiplying by ``1 / world``
    commutes with rounding when ``world`` is a power of two (outside the subnormal range), so
    ``sum(g * (1 / world)) == sum(g) * (1 / world)``. After the sum, the multiplication fuses into
    the gradient's consumer (the optimizer's kernel) and the collective can run in place on the
    gradient as the backward produced it (no scaled copy, see ``comm_fusion_with_concat``'s
    ``standalone_mb``)."""
    return world > 0 and world & (world - 1) == 0 and dtype in _POSTSCALE_DTYPES


def _prescale(graph: fx.Graph, marker: fx.Node, world: int) -> None:
    """DDP's mean: the gradient times ``1 / world`` before a sum (DDP multiplies while copying
    into its bucket; bucketing puts this multiplication into the packing kernel)."""
    grad = marker.args[0]
    with graph.inserting_before(marker):
        scaled = graph.call_function(torch.ops.aten.mul.Tensor, (grad, 1.0 / world))
    annotate(scaled, fqn=owner_of(str(marker.args[1])), phase=Phase.COMM)
    propagate_val(scaled, fake_mode_of(graph))
    marker.replace_input_with(grad, scaled)


def _postscale(graph: fx.Graph, wait: fx.Node, world: int, order: dict[fx.Node, int]) -> fx.Node:
    """DDP's mean taken after the sum (only where :func:`scales_after_sum`): ``wait * (1 /
    world)`` placed just before the reduced gradient's first reader, so that the wait can still
    move as late as that reader; returns the scaled node, which replaces the wait for every
    reader. ``order``: the graph's node order (before this expansion's insertions; the readers
    are the marker's, which it numbers)."""
    readers = list(wait.users)
    if any(r not in order for r in readers):
        order.update(node_order(graph))
    first = min(readers, key=order.__getitem__) if readers else wait.next
    with graph.inserting_before(first):
        scaled = graph.call_function(torch.ops.aten.mul.Tensor, (wait, 1.0 / world))
    inherit(scaled, wait)
    propagate_val(scaled, fake_mode_of(graph))
    for reader in readers:
        reader.replace_input_with(wait, scaled)
    return scaled


def _reduce_scatters(mode: DataParallel, graph: fx.Graph) -> bool:
    """``mode.reduce_scatters`` for the device of the graph's sharded gradients."""
    for node in graph.nodes:
        if ops.is_grad_shard_marker(node) and isinstance(node.meta.get("val"), torch.Tensor):
            return mode.reduce_scatters(node.meta["val"].device)
    return mode.reduce_scatters(torch.device("cpu"))


def _expand_compressed(graph: fx.Graph, marker: fx.Node, compression: Compression,
                       group_name: str) -> fx.Node:
    fqn = str(marker.args[1])
    out = add_compressed_all_reduce(graph, marker.args[0], compression, group_name,
                                    owner=owner_of(fqn), params=[fqn], before=marker)
    marker.replace_all_uses_with(out)
    graph.erase_node(marker)
    return out


def _insert_finite_check(graph: fx.Graph, wait: fx.Node) -> None:
    """``assert all(isfinite(grad))`` just before the gradient's first use (the optimizer), so
    a failing step updates nothing, and late enough not to pin the wait (or a bucket formed
    later) early in the graph."""
    comm = wait.args[0]  # the collective (through a compression cast back and its wait)
    while isinstance(comm, fx.Node) and not ops.is_collective(comm) and comm.args:
        comm = comm.args[0]
    fqn = ",".join(getattr(comm, "meta", {}).get(BUCKET_PARAMS_KEY, ())) or wait.name
    aten = torch.ops.aten
    order = node_order(graph)
    first_use = min(wait.users, key=order.__getitem__) if wait.users else wait.next
    with graph.inserting_before(first_use):
        finite = graph.call_function(aten.isfinite.default, (wait,))
    with graph.inserting_after(finite):
        every = graph.call_function(aten.all.default, (finite,))
    with graph.inserting_after(every):
        check = graph.call_function(
            aten._assert_async.msg, (every, f"spmd_backend: non-finite gradient for {fqn}")
        )
    val = wait.meta.get("val")
    if isinstance(val, torch.Tensor):
        from torch._subclasses.fake_tensor import FakeTensor

        mode = val.fake_mode if isinstance(val, FakeTensor) else None
        if mode is not None:
            with mode:
                finite.meta["val"] = torch.isfinite(val)
                every.meta["val"] = finite.meta["val"].all()
    for n in (finite, every, check):
        annotate(n, fqn=wait.meta.get("spmd_fqn"), phase=Phase.COMM)


@dataclass(frozen=True)
class _Chain:
    """What :func:`_reduce_chain` made of one parameter's ``grad_ready`` markers."""

    #: markers to expand into an all_reduce each
    reduced: list[fx.Node]
    #: the parameter's final gradient marker, when it is among ``reduced``
    last: fx.Node | None
    #: markers folded into a later one (reduced once, with the total)
    merged: int


def _accumulation(marker: fx.Node, nxt: fx.Node | None) -> fx.Node | None:
    """The ``add`` that accumulates a later backward's gradient onto ``marker``'s on the way to
    ``nxt`` (the parameter's next marker), or None (``nxt`` starts afresh: a ``zero_grad``
    between the backward calls, or there is no later one)."""
    src = nxt.args[0] if nxt is not None else None
    if isinstance(src, fx.Node) and src.target is aten.add.Tensor and marker in src.args[:2]:
        return src
    return None


def _reduce_chain(graph: fx.Graph, markers: list[fx.Node], contributions: list[fx.Node]) -> _Chain:
    """Which of one parameter's ``grad_ready`` markers (in graph order) are reduced.

    A gradient accumulated over several backward calls is reduced once, with the total, unless
    the step reads an intermediate gradient (SAM's perturbation from the first backward, a
    norm logged between two backward calls): DDP reduces every backward's gradient, so that
    reader must see the reduced value. Such a marker is reduced where it stands, and every
    later contribution accumulated onto it becomes a ``grad_contribution`` of its own (reduced
    alone, so ``sum`` never multiplies the reduced part again) whose accumulated result needs
    no further reduction."""
    reduced: list[fx.Node] = []
    last: fx.Node | None = None
    merged = 0
    base_reduced = False  # the gradient flowing into this marker already holds reduced values
    previous: fx.Node | None = None  # what stands for the previous marker's value now
    for i, m in enumerate(markers):
        nxt = markers[i + 1] if i + 1 < len(markers) else None
        acc = _accumulation(m, nxt)
        if base_reduced:
            add = m.args[0]
            new = add.args[1] if add.args[0] is previous else add.args[0]
            with graph.inserting_after(new):
                contribution = graph.call_function(GRAD_CONTRIBUTION, (new, m.args[1]))
            inherit(contribution, m)
            contribution.meta["val"] = new.meta.get("val")
            add.replace_input_with(new, contribution)
            contributions.append(contribution)
            m.replace_all_uses_with(add)
            graph.erase_node(m)
            base_reduced, previous = acc is not None, add
            continue
        observed = any(u is not acc for u in m.users)
        if nxt is None or observed:
            reduced.append(m)
            if nxt is None:
                last = m
            base_reduced, previous = acc is not None, m
        else:  # accumulated again later, read by nothing else: reduce the total once
            previous = m.args[0]
            m.replace_all_uses_with(previous)
            graph.erase_node(m)
            merged += 1
    return _Chain(reduced, last, merged)


def expand_data_parallel(
    gm: fx.GraphModule, mode: DataParallel, *, recompile: bool = True
) -> ExpansionReport:
    """Replace the tracer's markers in ``gm`` by collectives on ``mode``'s process group."""
    graph = gm.graph
    group_name = mode.group_name()
    grad_markers: dict[str, list[fx.Node]] = {}
    contributions: list[fx.Node] = []
    buffer_markers: list[fx.Node] = []
    for node in graph.nodes:
        if ops.is_grad_marker(node):
            grad_markers.setdefault(str(node.args[1]), []).append(node)
        elif ops.is_grad_contribution_marker(node):
            contributions.append(node)
        elif ops.is_buffer_marker(node):
            buffer_markers.append(node)

    merged = 0
    to_reduce: list[fx.Node] = []
    last_ready: dict[str, fx.Node] = {}
    for fqn, markers in grad_markers.items():
        chain = _reduce_chain(graph, markers, contributions)
        merged += chain.merged
        to_reduce.extend(chain.reduced)
        if chain.last is not None:
            last_ready[fqn] = chain.last
    world = mode.process_group().size()
    compression = mode.compression(world)
    shards = expand_shard_markers(
        graph, last_ready, reduce_op=mode.reduce_op,
        group_name=group_name, allow_reduce_scatter=_reduce_scatters(mode, graph),
        compression=compression,
    )
    for m in shards.consumed:
        to_reduce.remove(m)
        m.replace_all_uses_with(m.args[0])
        graph.erase_node(m)
    to_reduce.extend(contributions)
    order = node_order(graph)
    for marker in to_reduce:
        if compression is not None:
            wait = _expand_compressed(graph, marker, compression, group_name)
        else:
            val = marker.args[0].meta.get("val")
            after = isinstance(val, torch.Tensor) and scales_after_sum(world, val.dtype)
            if mode.reduce_op == "avg" and not after:
                _prescale(graph, marker, world)
            wait = _expand_marker(
                graph, marker, c10d.all_reduce.default, ("sum", group_name), "all_reduce"
            )
            if mode.reduce_op == "avg" and after:
                wait = _postscale(graph, wait, world, order)
        if mode.check_finite_grads:
            _insert_finite_check(graph, wait)
    broadcasts = expand_buffer_broadcasts(graph, buffer_markers, group_name)
    graph.lint()
    if recompile:
        gm.recompile()
    report = ExpansionReport(
        all_reduces=len(to_reduce),
        broadcasts=broadcasts,
        merged_markers=merged,
        group_name=group_name,
        reduce_op=mode.reduce_op,
        reduce_scatters=shards.reduce_scatters,
        all_gathers=shards.all_gathers,
    )
    log.debug("data-parallel expansion: %s", report)
    return report
