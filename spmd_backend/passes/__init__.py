"""The graph passes, one per file. Each is declared with its dependencies (usable directly, as
the upstream API does, or through :class:`spmd_backend.pass_manager.PassManager`)."""

from spmd_backend.passes.comm_fusion import comm_fusion_with_concat, plan_buckets
from spmd_backend.passes.iter_move import ModuleTarget, iter_move_grads_and_optimizers
from spmd_backend.passes.remove_copy import remove_copy_from_optimizer
from spmd_backend.passes.schedule_comm_wait import schedule_comm_wait
from spmd_backend.passes.split_optimizer import (
    get_all_fused_optimizer_blocks,
    split_fused_optimizer,
    split_optimizer_block,
)


def default_pipeline(bucket_size_mb: float, *, with_optimizer: bool = True) -> list[object]:
    """The default optimization passes (for a PassManager): bucketing, wait scheduling and,
    for full-step graphs that hold the optimizer, re-inplacing it."""
    passes: list[object] = [(comm_fusion_with_concat, {"bucket_size_mb": bucket_size_mb}), schedule_comm_wait]
    if with_optimizer:
        passes.append(remove_copy_from_optimizer)
    return passes


__all__ = [
    "default_pipeline",
    "ModuleTarget",
    "comm_fusion_with_concat",
    "get_all_fused_optimizer_blocks",
    "iter_move_grads_and_optimizers",
    "plan_buckets",
    "remove_copy_from_optimizer",
    "schedule_comm_wait",
    "split_fused_optimizer",
    "split_optimizer_block",
]
