"""torch 2.13's gloo with several functional all_gathers in flight: heap corruption, no spmd_backend.

Run: ``python tools/gloo_all_gather_repro.py [ITERATIONS] [MODE]`` (2 loopback gloo ranks).
Each iteration issues nine small ``all_gather_into_tensor`` (MODE ``many``, the default), or
nine with each waited before the next is issued (``one``), or nine ``all_reduce`` (``reduce``),
does a matmul, then waits them. Prints the ranks' exit codes: a negative code is the signal
that killed a rank (-6: glibc's "malloc(): unaligned tcache chunk detected" and the like, -11).
Measured 2026-11-25 (x86_64, 2 cores, torch 2.13.0 CPU): ``many`` crashed within 2,000
iterations in each of three runs; ``one`` and ``reduce`` ran 10,000 clean. This is why
:mod:`spmd_backend.parallel.gloo_all_gather` keeps one all_gather in flight per gloo group.
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = [11, 2, 24, 8, 40, 3, 1536, 256, 16]


def _rank(rank: int, world: int, port: int, iterations: int, mode: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    name = dist.group.WORLD.group_name
    c10d = torch.ops._c10d_functional
    for _ in range(iterations):
        shards = [torch.randn(n) for n in SIZES]
        outs = []
        for s in shards:
            if mode == "reduce":
                outs.append(c10d.all_reduce.default(s.clone(), "sum", name))
            else:
                outs.append(c10d.all_gather_into_tensor.default(s.clone(), world, name))
                if mode == "one":
                    c10d.wait_tensor.default(outs[-1])
        torch.randn(64, 64) @ torch.randn(64, 64)
        for o in outs:
            c10d.wait_tensor.default(o)
    dist.destroy_process_group()


def main() -> None:
    iterations = int(sys.argv[1]) if len(sys.argv) > 1 else 10000
    mode = sys.argv[2] if len(sys.argv) > 2 else "many"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, 2, port, iterations, mode)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    print(f"mode {mode}, {iterations} iterations: exit codes {[p.exitcode for p in procs]}")


if __name__ == "__main__":
    main()
