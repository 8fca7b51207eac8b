"""The pass-development harness: multi-rank runner, fake process group, DDP parity checks.

Library code never imports this package; tests, tools and examples do.
"""

from spmd_backend.testing.fake_pg import fake_process_group
from spmd_backend.testing.parity import OptimSpec, ParityCase, ParityResult, check_ddp_parity
from spmd_backend.testing.ranks import RankFailure, RankPool, RankTimeoutError, run_on_ranks

__all__ = [
    "DTensorTestBase",
    "skip_if_lt_x_gpu",
    "with_comms",
    "use_rank_pool",
    "fake_process_group",
    "OptimSpec",
    "ParityCase",
    "ParityResult",
    "check_ddp_parity",
    "RankFailure",
    "RankPool",
    "RankTimeoutError",
    "run_on_ranks",
]


_MULTIRANK = ("DTensorTestBase", "skip_if_lt_x_gpu", "with_comms", "use_rank_pool")


def __getattr__(name: str) -> object:
    # The unittest base imports torch.testing._internal (and expecttest): only on demand, so
    # `from spmd_backend.testing import run_on_ranks` works without the test extras.
    if name in _MULTIRANK:
        from spmd_backend.testing import multirank

        return getattr(multirank, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
