"""Marker ops the tracer leaves in the graph for later layers to expand.

``spmd_backend::grad_ready(Tensor grad, str fqn) -> Tensor``
    Wraps a parameter's gradient at the moment it becomes final in the backward (a
    post-accumulate-grad hook). The data-parallel layer replaces it by a gradient collective;
    a graph that is not expanded can strip it with :func:`strip_markers`.
``spmd_backend::buffer_sync(Tensor buf, str fqn) -> Tensor``
    Wraps a module buffer at the start of the step (DDP's ``broadcast_buffers``); expanded to a
    broadcast from the group's first rank.

Both are functional identities (they return a copy), so functionalization and fake tensors treat
them like any other op. ``fqn`` is the parameter's (or buffer's) state-dict name. The
data-parallel expansion (:mod:`spmd_backend.parallel.data_parallel`) replaces every marker.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("spmd_backend::grad_ready", mutates_args=())
def grad_ready(grad: torch.Tensor, fqn: str) -> torch.Tensor:
    return grad.clone()


@grad_ready.register_fake
def _grad_ready_fake(grad: torch.Tensor, fqn: str) -> torch.Tensor:
    return torch.empty_like(grad)


@torch.library.custom_op("spmd_backend::buffer_sync", mutates_args=())
def buffer_sync(buf: torch.Tensor, fqn: str) -> torch.Tensor:
    return buf.clone()


@buffer_sync.register_fake
def _buffer_sync_fake(buf: torch.Tensor, fqn: str) -> torch.Tensor:
    return torch.empty_like(buf)


GRAD_READY = torch.ops.spmd_backend.grad_ready.default
BUFFER_SYNC = torch.ops.spmd_backend.buffer_sync.default
