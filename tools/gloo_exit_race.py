"""Reproduce torch 2.13's hang when a gloo process group goes away right after DDP trained.

``loss.backward()`` stashes a Python object in the thread-local state; the gloo work DDP launches
from the backward captures that state, so the gloo worker thread that releases the work needs the
GIL. The group's destructor joins its workers with the GIL held (here DDP's reducer holds the
last reference, so the destructor runs when the model goes): a worker still releasing such a
work waits for the GIL forever, and the rank hangs.

Each round, on two spawned ranks: a process group, DDP trains two steps, then ``--mode`` ends
it: ``none`` (destroy at once), ``barrier`` (``dist.barrier()`` first) or ``sleep``
(``dist.barrier()``, then ``time.sleep(--sleep)`` with the GIL released). A rank that makes no
progress for ``--watchdog`` seconds prints its stacks and exits 1.

    python tools/gloo_exit_race.py --mode barrier --rounds 100

Measured results are in docs/reliability.md.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP


def _rank(rank: int, args: argparse.Namespace, folder: str) -> None:
    torch.set_num_threads(1)
    for r in range(args.rounds):
        faulthandler.dump_traceback_later(args.watchdog, exit=True)
        store = dist.FileStore(os.path.join(folder, f"round{r}"), 2)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
        model = DDP(torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(8)]),
                    bucket_cap_mb=0.001)  # one bucket per layer: many works per backward
        for _ in range(2):
            model(torch.randn(4, 32)).sum().backward()
        if args.mode in ("barrier", "sleep"):
            dist.barrier()
        if args.mode == "sleep":
            time.sleep(args.sleep)
        dist.destroy_process_group()
        del model  # the reducer held the group: its destructor runs here
    faulthandler.cancel_dump_traceback_later()
    if rank == 0:
        print(f"{args.rounds} rounds ended cleanly (mode {args.mode})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["none", "barrier", "sleep"], default="barrier")
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--sleep", type=float, default=0.2)
    parser.add_argument("--watchdog", type=float, default=60.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_rank, args=(args, folder), nprocs=2)


if __name__ == "__main__":
    main()
