"""Marker ops the tracer leaves in the graph for later layers to expand.

``spmd_backend::grad_ready(Tensor grad, str fqn) -> Tensor``
    Wraps a parameter's gradient at the moment it becomes final in the backward (a
    post-accumulate-grad hook). The data-parallel layer replaces it by a gradient collective;
    a graph that is not expanded can strip it with :func:`strip_markers`.
``spmd_backend::grad_contribution(Tensor grad, str fqn) -> Tensor``
    Wraps one backward's contribution to a parameter's gradient *before* it is accumulated
    into an existing ``.grad`` (a tensor hook). Used for parameters whose ``.grad`` already
    holds a reduced value from an earlier call (accumulation across calls): every contribution
    is reduced on its own, the earlier part never again.
``spmd_backend::buffer_sync(Tensor buf, str fqn) -> Tensor``
    Wraps a module buffer at the start of the step (DDP's ``broadcast_buffers``); expanded to a
    broadcast from the group's first rank.

``spmd_backend::grad_shard`` and ``spmd_backend::param_gather`` (defined at the end of this
file) carry a sharded optimizer step (:mod:`spmd_backend.tracing.sharding`): this rank's slice
of a reduced gradient, and every rank's updated shard of a parameter.

The first three are functional identities (they return a copy), so functionalization and fake tensors treat
them like any other op. ``fqn`` is the parameter's (or buffer's) state-dict name. The
data-parallel expansion (:mod:`spmd_backend.parallel.data_parallel`) replaces every marker.
"""

from __future__ import annotations

import torch

from spmd_backend.errors import SpmdUsageError


def check_dense_gradient(grad: torch.Tensor, fqn: str) -> None:
    """Refuse a sparse gradient (``nn.Embedding(sparse=True)``) before a marker wraps it: the
    collectives, bucketing and optimizer lowering handle dense (strided) gradients only."""
    if grad.layout != torch.strided:
        raise SpmdUsageError(
            f"spmd_backend: parameter {fqn!r} gets a {grad.layout} gradient (an "
            "nn.Embedding/EmbeddingBag with sparse=True?); spmd_backend reduces dense gradients "
            "only: construct the module with sparse=False (the default)"
        )


def _identity_marker(name: str) -> torch._ops.OpOverload:
    """Register ``spmd_backend::<name>(Tensor t, str fqn) -> Tensor`` (a copy of ``t``)."""

    def impl(t: torch.Tensor, fqn: str) -> torch.Tensor:
        return t.clone()

    def fake(t: torch.Tensor, fqn: str) -> torch.Tensor:
        return torch.empty_like(t)

    op = torch.library.custom_op(f"spmd_backend::{name}", impl, mutates_args=())
    op.register_fake(fake)
    return getattr(torch.ops.spmd_backend, name).default


GRAD_READY = _identity_marker("grad_ready")
GRAD_CONTRIBUTION = _identity_marker("grad_contribution")
BUFFER_SYNC = _identity_marker("buffer_sync")


# ---------------------------------------------------------------- sharded optimizer state
def shard_numel(numel: int, world: int) -> int:
    """Elements per rank of a flattened tensor of ``numel`` elements, zero-padded to a multiple
    of ``world``."""
    return max(1, -(-numel // world))


def local_shard(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """``rank``'s slice of ``t`` flattened and zero-padded to a multiple of ``world`` (a copy)."""
    chunk = shard_numel(t.numel(), world)
    start, stop = min(rank * chunk, t.numel()), min((rank + 1) * chunk, t.numel())
    piece = t.reshape(-1)[start:stop]  # only the slice is copied, never the padded whole
    if stop - start == chunk:
        return piece.clone()
    return torch.nn.functional.pad(piece, (0, chunk - (stop - start)))


def _grad_shard(grad: torch.Tensor, fqn: str, rank: int, world: int) -> torch.Tensor:
    return local_shard(grad, rank, world)


def _grad_shard_fake(grad: torch.Tensor, fqn: str, rank: int, world: int) -> torch.Tensor:
    return grad.new_empty(shard_numel(grad.numel(), world))


def _param_gather(shard: torch.Tensor, fqn: str, world: int) -> torch.Tensor:
    raise RuntimeError(
        "spmd_backend::param_gather ran unexpanded: a graph with a sharded optimizer runs only "
        "after the data-parallel expansion replaced its markers by collectives"
    )


def _param_gather_fake(shard: torch.Tensor, fqn: str, world: int) -> torch.Tensor:
    return shard.new_empty(shard.numel() * world)


#: ``spmd_backend::grad_shard(Tensor grad, str fqn, int rank, int world) -> Tensor``: this rank's
#: slice (``shard_numel`` elements) of the *reduced*, flattened, zero-padded gradient. Unexpanded
#: it slices the local gradient; the expansion turns it into a reduce_scatter (or a slice of the
#: all-reduced gradient when the full gradient is read elsewhere).
GRAD_SHARD = torch.library.custom_op("spmd_backend::grad_shard", _grad_shard, mutates_args=())
GRAD_SHARD.register_fake(_grad_shard_fake)
GRAD_SHARD = torch.ops.spmd_backend.grad_shard.default
#: ``spmd_backend::param_gather(Tensor shard, str fqn, int world) -> Tensor``: every rank's
#: updated shard of a parameter, concatenated in rank order (an all_gather after expansion).
PARAM_GATHER = torch.library.custom_op("spmd_backend::param_gather", _param_gather, mutates_args=())
PARAM_GATHER.register_fake(_param_gather_fake)
PARAM_GATHER = torch.ops.spmd_backend.param_gather.default


# ---------------------------------------------------------------- compiled-step cache key
def _pipeline_key(digest: str) -> None:
    return None


def _pipeline_key_fake(digest: str) -> None:
    return None


#: ``spmd_backend::pipeline_key(str digest) -> ()``: a no-op whose argument carries, in the
#: graph's code, what the backend's compile depends on besides the graph (its configuration,
#: its source, the process group): AOTAutograd's cache key covers the code, so an entry
#: compiled under another configuration is never served (:mod:`spmd_backend.dynamo.step_cache`).
#: The pipeline drops it before any pass runs.
PIPELINE_KEY = torch.library.custom_op(
    "spmd_backend::pipeline_key", _pipeline_key, mutates_args=()
)
PIPELINE_KEY.register_fake(_pipeline_key_fake)
PIPELINE_KEY = torch.ops.spmd_backend.pipeline_key.default
