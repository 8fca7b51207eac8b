"""A unittest base class whose ``@with_comms`` tests run on N ranks (the upstream seed's harness).

``DTensorTestBase`` mirrors what the upstream tests expect: ``self.rank``, ``self.world_size``
(override the property), ``self.device_type`` ("cuda" when enough GPUs are present, else
"cpu") and torch's ``TestCase.assertEqual`` tensor tolerances. A method decorated with
:func:`with_comms` runs, when called by the test runner, on ``world_size`` spawned ranks (gloo on
CPU, NCCL on GPU, loopback, per-test timeout) through :func:`spmd_backend.testing.run_on_ranks`;
inside a rank it runs the body with the process group initialized. A failure on any rank fails
the test with that rank's exception. Test classes must live in an importable module.

A test suite that keeps persistent ranks (a :class:`~spmd_backend.testing.RankPool`) can hand
them to these tests with :func:`use_rank_pool`: a method then runs as one job of that pool
instead of on two freshly spawned processes (each spends seconds importing torch).
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable
from typing import Any

import torch
from torch.testing._internal.common_utils import TestCase

from spmd_backend.testing.ranks import RankPool, run_on_ranks

_IN_RANK = False
#: ``(world_size, backend) -> RankPool | None``: persistent ranks for ``@with_comms``, if any
PoolProvider = Callable[[int, str], "RankPool | None"]
_POOL_PROVIDER: PoolProvider | None = None
#: seconds a multi-rank test method may take
TEST_TIMEOUT_S = float(os.environ.get("SPMD_TEST_RANK_TIMEOUT", "600"))


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


class DTensorTestBase(TestCase):
    """Base class for tests that run on several ranks (see the module docstring)."""

    rank: int = 0

    @property
    def world_size(self) -> int:
        return 2

    @property
    def device_type(self) -> str:
        return "cuda" if _gpus() >= self.world_size else "cpu"

    @property
    def backend(self) -> str:
        return "nccl" if self.device_type == "cuda" else "gloo"


def _run_method(rank: int, world_size: int, module: str, cls_name: str, method: str) -> None:
    global _IN_RANK
    _IN_RANK = True
    cls = getattr(importlib.import_module(module), cls_name)
    test = cls(method)
    test.rank = rank
    if test.device_type == "cuda":
        torch.cuda.set_device(rank)
    getattr(test, method)()


def use_rank_pool(provider: PoolProvider | None) -> PoolProvider | None:
    """Run ``@with_comms`` methods as jobs of persistent ranks: ``provider(world_size,
    backend)`` returns a live :class:`RankPool` of that size and backend, or ``None`` to spawn
    fresh processes for that method (the default; ``use_rank_pool(None)`` restores it). The
    pool's workers must have the test class's module importable. Returns the provider it
    replaces."""
    global _POOL_PROVIDER
    previous, _POOL_PROVIDER = _POOL_PROVIDER, provider
    return previous


def with_comms(func: Callable[..., Any]) -> Callable[..., Any]:
    """Run the decorated test method on ``self.world_size`` ranks."""

    @functools.wraps(func)
    def wrapper(self: DTensorTestBase, *args: Any, **kwargs: Any) -> Any:
        if _IN_RANK:
            return func(self, *args, **kwargs)
        where = (type(self).__module__, type(self).__qualname__, self._testMethodName)
        pool = _POOL_PROVIDER(self.world_size, self.backend) if _POOL_PROVIDER else None
        if pool is not None:
            pool.run(_run_method, *where, timeout=TEST_TIMEOUT_S)
        else:
            run_on_ranks(
                _run_method, *where,
                world_size=self.world_size, timeout=TEST_TIMEOUT_S, backend=self.backend,
            )
        return None

    return wrapper


def skip_if_lt_x_gpu(x: int) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The upstream "needs x GPUs" skip. Here it never skips: with fewer than ``x`` GPUs the
    test runs its ``x`` ranks on CPU (``device_type`` falls back to "cpu")."""

    def decorator(func: Callable[..., Any]) -> Callable[..., Any]:
        return func

    return decorator
