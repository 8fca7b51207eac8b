"""Seed-compatible face of the graph passes (``torch.distributed._spmd.graph_optimization``).

This module alone keeps the upstream contract: each pass here is a checked wrapper of the plain
pass of :mod:`spmd_backend.passes` (same declaration, same arguments) that records the names of
the passes applied so far in the process-wide set :data:`_optimized_func` (callers reset it with
``.clear()``) and fails with ``AssertionError`` when

* the pass already ran ("Cannot apply X twice."),
* a pass declared to follow it already ran ("[...] must be applied after X."), or
* a prerequisite has not run ("[...] are the prerequisites of X but are not applied.").

After the pass, the manager's post-pass work runs (lint, dead-code elimination, verification,
recompile: :func:`spmd_backend.pass_manager.run_pass`). :func:`graph_optimization_pass` is the
upstream decorator: it declares a function with :func:`~spmd_backend.pass_manager.declare_pass`
and returns such a wrapper. New code calls the plain passes or uses a
:class:`~spmd_backend.pass_manager.PassManager`, which never consult this record.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch.fx as fx

from spmd_backend import passes as _plain
from spmd_backend.errors import SpmdPassError
from spmd_backend.graph.optim import get_all_fused_optimizer_blocks
from spmd_backend.graph.utils import find_all_descendants as _descendants
from spmd_backend.pass_manager import DUMP_ENV, PassSpec, declare_pass, pass_spec_of, run_pass
from spmd_backend.passes import ModuleTarget

#: names of the passes applied so far through this face (reset it with ``.clear()``)
_optimized_func: set[str] = set()


def _apply_after(name: str) -> tuple[str, ...]:
    try:
        return pass_spec_of(name).apply_after
    except SpmdPassError:  # a name recorded by hand that no pass declares
        return ()


def _check_order(spec: PassSpec) -> None:
    name = spec.name
    if name in _optimized_func:
        raise AssertionError(f"Cannot apply {name} twice.")
    must_follow = sorted(other for other in _optimized_func if name in _apply_after(other))
    if must_follow:
        raise AssertionError(f"{must_follow} must be applied after {name}.")
    missing = sorted(set(spec.prerequisites) - _optimized_func)
    if missing:
        raise AssertionError(f"{missing} are the prerequisites of {name} but are not applied.")


def checked(spec: PassSpec) -> Callable[..., Any]:
    """A wrapper of ``spec.fn`` that enforces and records the upstream order (module docstring)."""

    @functools.wraps(spec.fn)
    def wrapper(gm: object, *args: Any, **kwargs: Any) -> Any:
        _check_order(spec)
        result, _ = run_pass(
            spec, gm, args, kwargs,
            dump_dir=os.environ.get(DUMP_ENV) or None, index=len(_optimized_func),
        )
        _optimized_func.add(spec.name)
        return result

    return wrapper


def graph_optimization_pass(
    prerequisites: Iterable[Callable[..., Any]], apply_after: Iterable[Callable[..., Any]]
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The seed's decorator: declare ``fn`` and return its order-checked wrapper."""
    prerequisites = list(prerequisites)
    apply_after = list(apply_after)

    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        return checked(declare_pass(fn, prerequisites=prerequisites, apply_after=apply_after))

    return decorator


comm_fusion_with_concat = checked(pass_spec_of(_plain.comm_fusion_with_concat))
schedule_comm_wait = checked(pass_spec_of(_plain.schedule_comm_wait))
remove_copy_from_optimizer = checked(pass_spec_of(_plain.remove_copy_from_optimizer))
split_fused_optimizer = checked(pass_spec_of(_plain.split_fused_optimizer))
iter_move_grads_and_optimizers = checked(pass_spec_of(_plain.iter_move_grads_and_optimizers))


def find_all_descendants(gm: object, parent_nodes: Sequence[fx.Node]) -> list[fx.Node]:
    """``parent_nodes`` and every node that uses them, transitively, in graph order."""
    if not parent_nodes:
        raise SpmdPassError("find_all_descendants: no parent nodes given")
    return _descendants(gm.graph, parent_nodes)  # type: ignore[attr-defined]


__all__ = [
    "ModuleTarget",
    "_optimized_func",
    "comm_fusion_with_concat",
    "find_all_descendants",
    "get_all_fused_optimizer_blocks",
    "graph_optimization_pass",
    "iter_move_grads_and_optimizers",
    "remove_copy_from_optimizer",
    "schedule_comm_wait",
    "split_fused_optimizer",
]
