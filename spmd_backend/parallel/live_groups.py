"""Per-process-group caches that let go of destroyed groups.

Some state lives per process group for the life of the process: the gloo group that carries a
group's schedule checks (``parallel/schedule_check.py``), the Dynamo door's backward check
(``dynamo/per_graph.py``) and its adopted-parameter registries (``dynamo/eager_grads.py``). Each is
keyed by the group object, so a group destroyed and created again (``destroy_process_group()``
then ``init_process_group()`` in one process: a sweep, a test suite, a restart in place) gets its
own. :func:`forget_destroyed` drops the entries of groups torch no longer knows, so such a cache
holds at most the live groups plus the one being added, instead of keeping every destroyed
group (and the side gloo group made for it) alive.

Requires: nothing beyond ``torch.distributed``. Guarantees: reads only
``dist.get_process_group_ranks``; never touches a live group's entry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

V = TypeVar("V")


def is_live(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` is still one of torch.distributed's groups (not destroyed)."""
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, RuntimeError, ValueError):
        return False
    return True


def forget_destroyed(cache: dict[Any, V], group_of: Callable[[V], dist.ProcessGroup]) -> None:
    """Remove from ``cache`` every entry whose group (``group_of(value)``) was destroyed."""
    for key in [k for k, v in cache.items() if not is_live(group_of(v))]:
        del cache[key]


__all__ = ["forget_destroyed", "is_live"]
