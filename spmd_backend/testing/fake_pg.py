"""A single-process fake process group for graph tests (no other processes, no communication).

``with fake_process_group(world_size=2):`` initializes torch.distributed with torch's "fake"
backend: collectives trace and run instantly (results are the inputs, unreduced), which is all a
graph-structure test needs. The group is destroyed on exit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist


@contextlib.contextmanager
def fake_process_group(world_size: int = 2, rank: int = 0) -> Iterator[dist.ProcessGroup]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("fake_process_group: a process group is already initialized")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield dist.group.WORLD  # type: ignore[misc]
    finally:
        dist.destroy_process_group()
