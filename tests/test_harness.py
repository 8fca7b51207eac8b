"""spmd_backend.testing: the multi-rank runner re-raises rank failures and kills hung jobs."""

from __future__ import annotations

import os
import tempfile
import time

import pytest
import torch

import spmd_backend
from spmd_backend.testing import (
    DTensorTestBase,
    RankPool,
    RankTimeoutError,
    multirank,
    run_on_ranks,
    with_comms,
)

pytestmark = pytest.mark.multirank


def _rank_and_sum(rank: int, world_size: int, offset: int) -> tuple[int, float]:
    import torch.distributed as dist

    t = torch.tensor([float(rank + offset)])
    dist.all_reduce(t)
    return rank, float(t)


def _fail_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise KeyError("boom on rank one")
    import torch.distributed as dist

    dist.barrier()  # rank 0 waits for rank 1, which never arrives


def _sleep(rank: int, world_size: int, seconds: float) -> None:
    time.sleep(seconds)


def _crash_on_rank_one(rank: int, world_size: int) -> None:
    import os
    import signal

    if rank == 1:
        os.kill(os.getpid(), signal.SIGSEGV)  # a native crash, as heap corruption ends
    time.sleep(30)


def _unmatched_collective_on_rank_zero(rank: int, world_size: int) -> int:
    import torch.distributed as dist

    t = torch.ones(3)
    dist.all_reduce(t)
    if rank == 0:  # a collective the other rank never joins: the group is out of step
        torch.ops._c10d_functional.all_reduce.default(t, "sum", dist.group.WORLD.group_name)
    return rank


def test_a_rank_killed_by_a_signal_shows_its_last_output():
    pool = RankPool(2, timeout=60, failure_grace=2)
    try:
        with pytest.raises(Exception, match="rank 1 exited with code -11") as info:
            pool.run(_crash_on_rank_one, timeout=60)
        assert "Fatal Python error: Segmentation fault" in str(info.value)  # faulthandler
        assert "_crash_on_rank_one" in str(info.value)  # where it was
    finally:
        pool.close(kill=True)


def test_a_job_that_leaves_the_ranks_out_of_step_retires_the_pool():
    pool = RankPool(2, timeout=60)
    try:
        assert pool.run(_rank_and_sum, 0) == [(0, 1.0), (1, 1.0)]
        assert pool.alive and not pool.retired
        assert pool.run(_unmatched_collective_on_rank_zero) == [0, 1]  # the job itself passed
        assert not pool.alive
        assert "collectives issued per rank" in pool.retired and "not waited [1, 0]" in pool.retired
    finally:
        pool.close(kill=True)


def test_run_on_ranks_returns_per_rank_results():
    assert run_on_ranks(_rank_and_sum, 10, world_size=2) == [(0, 21.0), (1, 21.0)]


def test_rank_failure_is_reraised_with_its_type_and_traceback(rank_pool):
    with pytest.raises(KeyError, match="boom on rank one") as info:
        rank_pool.run(_fail_on_rank_one, timeout=60)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "remote traceback of rank 1" in notes and "_fail_on_rank_one" in notes
    assert not rank_pool.alive


def test_hung_job_times_out_and_kills_workers():
    pool = RankPool(2, timeout=30)
    try:
        start = time.monotonic()
        with pytest.raises(RankTimeoutError, match="did not finish within 2s"):
            pool.run(_sleep, 60, timeout=2)
        assert time.monotonic() - start < 20
        assert not pool.alive
        assert all(not p.is_alive() for p in pool._procs)
    finally:
        pool.close(kill=True)


def _bad_input_on_every_rank(rank: int, world_size: int) -> str:
    from spmd_backend.testing.models import MLP

    model = MLP(8, 16, 2, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @spmd_backend.compile()
    def step(model, optim, batch):
        loss = model(batch).sum()  # backward forgotten
        optim.step()
        return loss

    try:
        step(model, opt, torch.randn(2, 8))
    except spmd_backend.SpmdUsageError as e:
        return str(e)
    return "no error"


def test_bad_input_fails_on_every_rank_without_hanging(rank_pool):
    messages = rank_pool.run(_bad_input_on_every_rank, timeout=60)
    assert all("loss.backward() was never called" in m for m in messages), messages


class RecordsItsRanks(DTensorTestBase):
    """A seed-style test class; its method writes which process ran each rank."""

    __test__ = False  # run only by the test below

    @with_comms
    def test_record(self) -> None:
        import os

        path = os.path.join(tempfile.gettempdir(), f"spmd_with_comms_{os.getppid()}_{self.rank}")
        with open(path, "w") as f:
            f.write(str(os.getpid()))


def _with_comms_pids() -> list[int]:
    pids = []
    for rank in range(2):
        path = os.path.join(tempfile.gettempdir(), f"spmd_with_comms_{os.getpid()}_{rank}")
        with open(path) as f:
            pids.append(int(f.read()))
        os.remove(path)
    return pids


def test_with_comms_runs_on_the_pool_it_is_given(rank_pool):
    suite_provider = multirank.use_rank_pool(lambda world_size, backend: rank_pool)
    try:
        RecordsItsRanks("test_record").test_record()
        assert _with_comms_pids() == [p.pid for p in rank_pool._procs]
        multirank.use_rank_pool(lambda world_size, backend: None)  # spawn fresh ranks
        RecordsItsRanks("test_record").test_record()
        fresh = _with_comms_pids()
        assert not set(fresh) & {p.pid for p in rank_pool._procs}
        assert rank_pool.alive
    finally:
        multirank.use_rank_pool(suite_provider)
