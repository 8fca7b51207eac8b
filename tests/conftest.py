"""Shared fixtures: one Inductor cache for the whole suite, a fake process group, a rank pool
(two persistent gloo ranks per pytest process, which the seeds' ``@with_comms`` tests share)."""

from __future__ import annotations

import os
import pathlib

_REPO = pathlib.Path(__file__).resolve().parent.parent
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(_REPO / ".cache" / "inductor"))
# tests that lower with Inductor check Inductor's code from the first step (and do not spend the
# suite's two cores on workers); tests/test_background_compile.py turns the background compile on
os.environ.setdefault("SPMD_BACKEND_BACKGROUND_COMPILE", "0")
# torch's CPU allocator backs tensors over 2 MB with transparent huge pages (where the kernel
# allows them): the seeds' 84M-parameter steps fault in fresh buffers each op (46.7 s -> 39.7 s
# for find_all_descendants). Read when torch allocates, so it must be set before the ranks start.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import pytest  # noqa: E402
import torch.distributed as dist  # noqa: E402

from spmd_backend.testing import (  # noqa: E402
    RankPool,
    fake_process_group,
    multirank,
)

#: seconds one multi-rank job may take before its workers are killed
RANK_JOB_TIMEOUT = float(os.environ.get("SPMD_TEST_RANK_TIMEOUT", "180"))


@pytest.fixture
def fake_pg():
    """A single-process fake process group of world size 2 (collectives are no-ops)."""
    with fake_process_group(world_size=2) as pg:
        yield pg


#: this pytest process's persistent ranks (one pool, recreated after a failed or timed-out job)
_POOL: dict[str, RankPool | None] = {"pool": None}


def _shared_pool() -> RankPool:
    pool = _POOL["pool"]
    if pool is None or not pool.alive:
        pool = RankPool(
            2,
            timeout=RANK_JOB_TIMEOUT,
            failure_grace=5.0,
            env={"TORCHINDUCTOR_CACHE_DIR": os.environ["TORCHINDUCTOR_CACHE_DIR"]},
            retain_memory=True,
        )
        _POOL["pool"] = pool
    return pool


def _seed_ranks(world_size: int, backend: str) -> RankPool | None:
    """The seeds' ``@with_comms`` methods run as jobs of the same two ranks (spawning two
    processes per method cost each seed test about 12 s of CPU importing torch)."""
    return _shared_pool() if (world_size, backend) == (2, "gloo") else None


def pytest_configure(config):
    multirank.use_rank_pool(_seed_ranks)


def pytest_unconfigure(config):
    multirank.use_rank_pool(None)
    pool = _POOL["pool"]
    if pool is not None:
        pool.close()


@pytest.fixture
def rank_pool() -> RankPool:
    """Two persistent gloo ranks on loopback, recreated after a failed or timed-out job."""
    return _shared_pool()


@pytest.fixture(autouse=True)
def _no_leaked_process_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("the test left a process group initialized")


#: the seed's large-model cases (dim 4096, 2-5 layers on 2 CPU ranks): correct but slow
_SLOW_SEED_CASES = {
    "test_graph_optimization_with_foreach",
    "test_graph_optimization_with_fused",
    "test_split_fused_optimizer",
    "test_iter_move_blocks_and_optimizers",
    "test_find_all_descendants",
}


def pytest_collection_modifyitems(config, items):
    _mark_seed_conflicts(items)
    for item in items:
        if item.name in _SLOW_SEED_CASES or "test_seed_transformation" in item.nodeid and "inductor" in item.name:
            item.add_marker(pytest.mark.slow)


def _mark_seed_conflicts(items):
    """Seed 000 is an older revision of seed 001: its test_ac expects the backward sequence to
    stop before post_bw of ``Foo.linears.0`` and ``Foo``, which 001 (the contract we implement)
    requires. Both cannot pass; 000's truncated expectation is a strict expected failure."""
    for item in items:
        if item.nodeid.endswith("test_seed_mod_tracker_000.py::TestModTracker::test_ac"):
            item.add_marker(pytest.mark.xfail(
                strict=True,
                reason="seed 000's test_ac predates post_bw for modules without grad inputs (seed 001)",
            ))
