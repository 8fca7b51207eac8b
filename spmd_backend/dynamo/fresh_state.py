"""Create a fresh optimizer's state before Dynamo traces the step that would create it.

A step whose optimizer has no state yet traces differently from every later step (the first
creates ``exp_avg``... inside the graph, the others read them), so Dynamo compiles the whole step
twice: once for the first call, once more when its guard on the empty state fails. For torch's
optimizers whose state starts independent of the gradient's values (the Adam family, RMSprop,
Adamax, NAdam, RAdam, Adadelta, ASGD, Rprop, ...), :func:`create_fresh_state` runs the
optimizer's own ``_init_group`` eagerly, on zero gradients standing in for the ones the step
will compute, so the first trace already reads the state and is the only compile. The state is
exactly what the first eager step would have created (the same code makes it); the one
difference is that a trainable parameter which never receives a gradient also gets an entry.

Requires: called while no frame is being traced (``scope.install``'s frame hook calls it before
Dynamo traces a frame for the spmd backend). Guarantees: only optimizers with no state for any
parameter of a group are touched; a parameter's ``.grad`` is as before afterwards;
:func:`remove_state` undoes the creation exactly (the hook calls it when the compile fails).
SGD creates its momentum buffer from the first gradient's value and is left alone (its first
step compiles twice, as in the compile door's bootstrap); optimizers that are not torch.optim
classes are left alone.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterable
from typing import Any

import torch

from spmd_backend.dynamo import frame

log = logging.getLogger(__name__)

#: optimizers whose first state depends on the first gradient's values, not only its shape
_VALUE_DEPENDENT = frozenset({"SGD"})


def _torch_optimizer(obj: Any) -> bool:
    cls = type(obj)
    return (
        isinstance(obj, torch.optim.Optimizer)
        and cls.__module__.startswith("torch.optim")
        and cls.__name__ not in _VALUE_DEPENDENT
        and callable(getattr(cls, "_init_group", None))
    )


def optimizers_of_frame(code: Any, frame_locals: Any, frame_globals: Any, closure: Any) -> list[Any]:
    """The torch.optim optimizers a frame reaches directly (:func:`frame.frame_values`)."""
    found: dict[int, Any] = {}
    for v in frame.frame_values(code, frame_locals, frame_globals, closure):
        if _torch_optimizer(v):
            found.setdefault(id(v), v)
    return list(found.values())


def _fresh_groups(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [
        g for g in opt.param_groups
        if not any(p in opt.state for p in g["params"])
        and any(p.requires_grad for p in g["params"])
    ]


def create_fresh_state(optimizers: Iterable[torch.optim.Optimizer]) -> list[tuple[Any, Any]]:
    """Run ``_init_group`` of every fresh param group of the torch.optim optimizers among
    ``optimizers`` on zero stand-in gradients; returns the ``(optimizer, parameter)`` entries
    created."""
    created: list[tuple[Any, Any]] = []
    for opt in optimizers:
        groups = _fresh_groups(opt) if _torch_optimizer(opt) else []
        if not groups:
            continue
        n_lists = len(inspect.signature(type(opt)._init_group).parameters) - 2  # self, group
        for group in groups:
            trainable = [p for p in group["params"] if p.requires_grad]
            standing_in = [p for p in trainable if p.grad is None]
            try:
                with torch.no_grad():
                    for p in standing_in:
                        p.grad = torch.zeros_like(p)
                    type(opt)._init_group(opt, group, *[[] for _ in range(n_lists)])
            finally:
                for p in standing_in:
                    p.grad = None
            created.extend((opt, p) for p in trainable if p in opt.state)
        log.info('backend="spmd": created the state of a fresh %s before tracing (one compile '
                 "instead of two)", type(opt).__name__)
    return created


def remove_state(created: Iterable[tuple[Any, Any]]) -> None:
    """Undo :func:`create_fresh_state`."""
    for opt, p in created:
        opt.state.pop(p, None)


__all__ = ["create_fresh_state", "optimizers_of_frame", "remove_state"]
