"""The graph passes, one per file.

Each pass is a plain function ``pass(gm, ...)`` that edits ``gm.graph`` in place and keeps no
state: it can be called on any graph, any number of times, in any order (a graph without the
pattern it rewrites is a logged no-op). Each is declared once with
:func:`spmd_backend.pass_manager.declare_pass` (its dependencies named by string), which is what
a :class:`~spmd_backend.pass_manager.PassManager` orders and verifies by.
:mod:`spmd_backend.graph_optimization` wraps the same functions in the upstream seed's
order-checking contract.

Also exported because the upstream API offers them next to the passes:
:func:`~spmd_backend.graph.optim.get_all_fused_optimizer_blocks` and
:func:`~spmd_backend.graph.optim_surgery.split_optimizer_block` (the surgery behind
``split_fused_optimizer``, for use inside other passes).
"""

from __future__ import annotations

from spmd_backend.graph.optim import get_all_fused_optimizer_blocks
from spmd_backend.graph.optim_surgery import split_optimizer_block
from spmd_backend.passes.comm_fusion import CPU_STANDALONE_MB, comm_fusion_with_concat, plan_buckets
from spmd_backend.passes.commit_late import commit_writes_late
from spmd_backend.passes.iter_move import ModuleTarget, iter_move_grads_and_optimizers
from spmd_backend.passes.remove_copy import remove_copy_from_optimizer
from spmd_backend.passes.schedule_comm_wait import schedule_comm_wait
from spmd_backend.passes.split_optimizer import split_fused_optimizer


def default_pipeline(bucket_size_mb: float, *, with_optimizer: bool = True) -> list[object]:
    """The default optimization passes (for a PassManager): bucketing (large CPU gradients
    reduced alone, in place), wait scheduling and,
    for full-step graphs that hold the optimizer, re-inplacing it and writing inputs back after
    the last collective."""
    passes: list[object] = [
        (comm_fusion_with_concat, {"bucket_size_mb": bucket_size_mb,
                                   "standalone_mb": CPU_STANDALONE_MB}),
        schedule_comm_wait,
    ]
    if with_optimizer:
        passes += [remove_copy_from_optimizer, commit_writes_late]
    return passes


__all__ = [
    "default_pipeline",
    "ModuleTarget",
    "comm_fusion_with_concat",
    "commit_writes_late",
    "get_all_fused_optimizer_blocks",
    "iter_move_grads_and_optimizers",
    "plan_buckets",
    "remove_copy_from_optimizer",
    "schedule_comm_wait",
    "split_fused_optimizer",
    "split_optimizer_block",
]
