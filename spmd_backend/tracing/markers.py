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

All three are functional identities (they return a copy), so functionalization and fake tensors treat
them like any other op. ``fqn`` is the parameter's (or buffer's) state-dict name. The
data-parallel expansion (:mod:`spmd_backend.parallel.data_parallel`) replaces every marker.
"""

from __future__ import annotations

import torch


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
