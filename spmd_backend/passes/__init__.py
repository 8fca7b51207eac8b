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

#: the default optimization pipeline of GraphModuleTransformation, in any order (the manager sorts)
DEFAULT_PIPELINE = (comm_fusion_with_concat, schedule_comm_wait, remove_copy_from_optimizer)

__all__ = [
    "DEFAULT_PIPELINE",
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
