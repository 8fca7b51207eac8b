"""A process group destroyed and created again in one process (a sweep, a restart in place) is
not kept alive by spmd_backend's per-group caches (parallel/live_groups.py): the schedule
check's channel, the Dynamo door's backward check and its adopted-parameter registries each
hold only live groups. Run in a fresh interpreter: the suite's own ranks keep their group."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import gc, json, tempfile, weakref
    import torch, torch.distributed as dist
    from spmd_backend.dynamo import eager_grads, per_graph
    from spmd_backend.parallel import schedule_check
    from spmd_backend.parallel.data_parallel import DataParallel

    def init():
        dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0,
                                world_size=1)

    def use_every_cache():
        group = dist.group.WORLD
        schedule_check.cpu_channel(group, torch.device("cpu"))
        per_graph.backward_schedule(group)
        assert eager_grads.for_mode(DataParallel()) is not None
        return weakref.ref(group)

    init()
    first = use_every_cache()
    dist.destroy_process_group()
    init()
    second = use_every_cache()
    gc.collect()
    sizes = [len(schedule_check._CHANNELS), len(per_graph._SCHEDULES), len(eager_grads._REGISTRIES)]
    dist.destroy_process_group()
    print(json.dumps({"first": first() is not None, "second": second() is not None, "sizes": sizes}))
    """
)


def test_a_destroyed_group_is_let_go():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out == {"first": False, "second": True, "sizes": [1, 1, 1]}, out
