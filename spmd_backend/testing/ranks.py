"""Run a function on N ranks: spawned processes, loopback gloo, a free port, a timeout.

:func:`run_on_ranks` spawns fresh processes for one function; :class:`RankPool` keeps N worker
processes (with their process group) alive and runs many jobs on them, which is what a test
suite wants (spawning and importing torch costs seconds per process).

Guarantees: the rendezvous store binds to 127.0.0.1 on a port the OS picked (no race on a
"free" port); a job that does not finish within its timeout kills the workers and raises
:class:`RankTimeoutError` in the parent; an exception on any rank is re-raised in the parent as
the original exception (from the lowest failing rank) with every failing rank's remote traceback
attached as a note. Functions and arguments must be picklable (module-level functions). Each
rank runs ``torch.get_num_threads() == rank_threads(world_size)``: its share of the cores.
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
import pickle
import queue
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.multiprocessing as mp

from spmd_backend.errors import SpmdError
from spmd_backend.testing.heap import retain_freed_memory

log = logging.getLogger(__name__)

_LOOPBACK = "127.0.0.1"


class RankTimeoutError(SpmdError, TimeoutError):
    """A multi-rank job did not finish in time; its workers were killed."""


class RankFailure(SpmdError, RuntimeError):
    """A rank raised an exception that could not be sent to the parent as itself."""


@dataclass
class _Outcome:
    rank: int
    ok: bool
    value: Any = None
    error: bytes | None = None
    text: str = ""
    secondary: bool = False  # failed only because another rank failed or the process died
    in_flight: int = 0  # functional collectives issued by the job and never waited
    collectives: int = -1  # collectives issued on the default group so far (-1: unknown)


def _init_pg(rank: int, world_size: int, port: int, backend: str, timeout_s: float) -> None:
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", _LOOPBACK)
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_RANK"] = str(rank)
    store = dist.TCPStore(
        _LOOPBACK, port, world_size, is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def rank_threads(world_size: int) -> int:
    """Intra-op threads of each rank process: ``SPMD_RANK_THREADS`` when set, else the
    machine's cores divided among the ranks (at least one)."""
    forced = os.environ.get("SPMD_RANK_THREADS")
    if forced:
        return max(1, int(forced))
    return max(1, (os.cpu_count() or 1) // world_size)


def _log_to(path: str) -> None:
    """Send this process's native output (fd 1 and 2: glibc's and gloo's abort messages, C++
    warnings) to ``path``, and Python's stacks there on a fatal signal (faulthandler), so that
    the parent can show why a rank died instead of only its exit code."""
    import faulthandler
    import sys

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for stream, target in ((sys.stdout, 1), (sys.stderr, 2)):
        stream.flush()
        os.dup2(fd, target)
    os.close(fd)
    faulthandler.enable(all_threads=True)


def _in_flight() -> int:
    """Functional collectives this process issued and has not waited (torch's work registry)."""
    try:
        from torch._C._distributed_c10d import _get_work_registry_size
    except ImportError:  # pragma: no cover - torch without the registry
        return 0
    return int(_get_work_registry_size())


def _issued() -> int:
    """How many collectives this rank has issued on the default process group (its sequence
    number; -1 when the group does not count them or is gone)."""
    import torch.distributed as dist

    try:
        return int(dist.distributed_c10d._get_default_group()._get_sequence_number_for_group())
    except Exception:  # noqa: BLE001 - no default group, or a backend without sequence numbers
        return -1


def _tail(path: str, lines: int = 40) -> str:
    """The last ``lines`` lines of a rank's output file (empty when it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _pack_error(rank: int, exc: BaseException) -> _Outcome:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        blob = pickle.dumps(exc)
        pickle.loads(blob)
    except Exception:  # noqa: BLE001 - unpicklable exceptions are sent as text
        blob = None
    return _Outcome(rank=rank, ok=False, error=blob, text=text)


def _worker(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    timeout_s: float,
    jobs: Any,
    results: Any,
    env: dict[str, str],
    log_path: str,
    retain_memory: bool = False,
) -> None:
    if retain_memory:
        retain_freed_memory()
    os.environ.update(env)
    _log_to(log_path)
    # the ranks share the machine's cores: one intra-op pool per rank sized to its share (two
    # ranks of two threads each on two cores spin against each other: 51 s against 45 s for
    # the seed's find_all_descendants test)
    torch.set_num_threads(rank_threads(world_size))
    try:
        _init_pg(rank, world_size, port, backend, timeout_s)
    except BaseException as e:  # noqa: BLE001
        results.put(_pack_error(rank, e))
        return
    results.put(_Outcome(rank=rank, ok=True, value="ready"))
    while True:
        job = jobs.get()
        if job is None:
            break
        fn, args, kwargs = job
        try:
            value = fn(rank, world_size, *args, **kwargs)
            try:
                pickle.dumps(value)
            except Exception:  # noqa: BLE001
                value = repr(value)
            outcome = _Outcome(rank=rank, ok=True, value=value)
        except BaseException as e:  # noqa: BLE001
            outcome = _pack_error(rank, e)
        if not outcome.ok:
            # a failed job's traceback holds its frames and model in reference cycles; left to
            # the collector they went at another time on each rank, with process-wide
            # registries they were in (per-graph mode's adopted eager parameters), and a later
            # job's cross-rank check failed on a difference that was only this garbage
            gc.collect()
        outcome.in_flight, outcome.collectives = _in_flight(), _issued()
        results.put(outcome)
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


def _raise_failures(outcomes: Sequence[_Outcome]) -> None:
    failed = sorted((o for o in outcomes if not o.ok), key=lambda o: (o.secondary, o.rank))
    if not failed:
        return
    first = failed[0]
    exc: BaseException
    if first.error is not None:
        exc = pickle.loads(first.error)
    else:
        exc = RankFailure(f"rank {first.rank} failed:\n{first.text}")
    for o in failed:
        exc.add_note(f"--- remote traceback of rank {o.rank} ---\n{o.text}")
    raise exc


class RankPool:
    """``world_size`` persistent worker processes sharing one process group.

    ``pool.run(fn, *args, timeout=...)`` calls ``fn(rank, world_size, *args)`` on every rank
    and returns the list of per-rank results. After a timeout or a failure the pool is dead
    (:attr:`alive` is False); create a new one. When one rank fails, the others get
    ``failure_grace`` seconds to finish or fail before they are killed. With
    ``retain_memory=True`` each worker keeps the memory its jobs free for the next ones
    (:func:`~spmd_backend.testing.heap.retain_freed_memory`): a test suite's ranks stop
    zero-filling fresh pages for every step, at the cost of holding their peak heap.
    """

    def __init__(
        self,
        world_size: int = 2,
        *,
        backend: str = "gloo",
        timeout: float = 120.0,
        env: dict[str, str] | None = None,
        failure_grace: float = 10.0,
        retain_memory: bool = False,
    ) -> None:
        import torch.distributed as dist

        self.world_size = world_size
        self.timeout = timeout
        self.failure_grace = failure_grace
        ctx = mp.get_context("spawn")
        # The parent owns the store server: port 0 lets the OS pick a free port atomically.
        self._store = dist.TCPStore(
            _LOOPBACK, 0, world_size, is_master=True, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=max(timeout, 60.0)),
        )
        port = self._store.port
        self._logs = tempfile.mkdtemp(prefix="spmd_ranks_")
        self._results = ctx.Queue()
        self._jobs = [ctx.Queue() for _ in range(world_size)]
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, port, backend, max(timeout, 60.0), self._jobs[r],
                      self._results, dict(env or {}), self.log_path(r), retain_memory),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self.alive = True
        self.retired = ""  # why the pool closed itself after a job that passed
        _raise_failures(self._collect(timeout=max(timeout, 120.0), what="start-up"))

    def _collect(self, timeout: float, what: str) -> list[_Outcome]:
        deadline = time.monotonic() + timeout
        outcomes: dict[int, _Outcome] = {}
        while len(outcomes) < self.world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                self.close(kill=True)
                missing = sorted(set(range(self.world_size)) - set(outcomes))
                if any(not o.ok for o in outcomes.values()):
                    # a rank failed and the others are stuck waiting for it: report the failure
                    for r in missing:
                        outcomes[r] = _Outcome(
                            rank=r, ok=False,
                            text=f"rank {r} did not finish after another rank failed; killed",
                            secondary=True,
                        )
                    return [outcomes[r] for r in range(self.world_size)]
                raise RankTimeoutError(
                    f"{what} did not finish within {timeout:.0f}s on ranks {missing}; "
                    "workers were killed"
                )
            try:
                o = self._results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in outcomes]
                if dead:
                    for r in dead:
                        outcomes[r] = _Outcome(
                            rank=r, ok=False,
                            text=f"rank {r} exited with code {self._procs[r].exitcode}; the "
                                 f"end of its output ({self.log_path(r)}):\n"
                                 f"{_tail(self.log_path(r))}",
                        )
                    # the others may be waiting for the dead rank: a grace period, as on failure
                    deadline = min(deadline, time.monotonic() + self.failure_grace)
                continue
            outcomes[o.rank] = o
            if not o.ok:
                # give the other ranks a short grace period to fail (or finish) too
                deadline = min(deadline, time.monotonic() + self.failure_grace)
        return [outcomes[r] for r in range(self.world_size)]

    def _retire_if_out_of_step(self, name: str, outcomes: Sequence[_Outcome]) -> None:
        """Close the pool when a job that passed left its ranks out of step: a different number
        of collectives issued on each rank (a fault test where one rank raised before a
        collective), or collectives never waited. gloo matches collectives by their order, so
        the next job's would pair with the wrong ones (sizes that differ: a rank aborts or
        crashes later, far from the cause)."""
        counts = [o.collectives for o in outcomes]
        in_flight = [o.in_flight for o in outcomes]
        if len(set(counts)) > 1 or any(in_flight):  # (-1 on a rank: its group is gone)
            self.retired = (f"{name} left the ranks out of step (collectives issued per rank "
                            f"{counts}, not waited {in_flight}); the pool is closed")
            log.info(self.retired)
            self.close(kill=True)

    def log_path(self, rank: int) -> str:
        """Where rank ``rank`` writes its native output (and faulthandler's stacks)."""
        return os.path.join(self._logs, f"rank{rank}.log")

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> list[Any]:
        if not self.alive:
            raise RankFailure("this RankPool was closed (after a timeout?); create a new one")
        for q in self._jobs:
            q.put((fn, args, kwargs))
        name = getattr(fn, "__name__", "job")
        outcomes = self._collect(timeout or self.timeout, name)
        if any(not o.ok for o in outcomes):
            # a failed rank may leave the process group unusable: do not reuse this pool
            self.close(kill=True)
        else:
            self._retire_if_out_of_step(name, outcomes)
        _raise_failures(outcomes)
        return [o.value for o in outcomes]

    def close(self, kill: bool = False) -> None:
        if not self.alive:
            return
        self.alive = False
        if not kill:
            for q in self._jobs:
                q.put(None)
            for p in self._procs:
                p.join(timeout=10)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_on_ranks(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    timeout: float = 120.0,
    backend: str = "gloo",
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Spawn ``world_size`` processes, call ``fn(rank, world_size, *args)`` on each, tear down."""
    with RankPool(world_size, backend=backend, timeout=timeout, env=env) as pool:
        return pool.run(fn, *args, timeout=timeout, **kwargs)
