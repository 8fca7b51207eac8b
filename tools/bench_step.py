"""Benchmark: first-call trace time and steady-state step time of spmd_backend.compile vs DDP.

    python tools/bench_step.py [--ranks 2] [--steps 20] [--out out/bench_step.json]

Runs on N loopback gloo ranks (spawned), measuring in ONE run, interleaving the variants step by
step so that machine noise hits both alike:

* trace time of the first call (and the second, steady-state trace) for a 12-layer GPT;
* median steady-state step time of DDP eager and of spmd_backend.compile (no transformation)
  for a GPT-style transformer and the seed's DummyModel MLP, and their ratio.

Prints a markdown table and writes the numbers as JSON. A benchmark, not a test: read ratios,
not absolute times, on a noisy machine.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import pathlib
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from spmd_backend.testing import run_on_ranks  # noqa: E402


def _lm_step(model, optim, batch):
    import torch.nn.functional as F

    logits = model(batch)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _mlp_step(model, optim, batch):
    loss = model(batch).sum()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _workloads():
    from spmd_backend.testing.models import GPT, DummyModel

    return {
        "gpt-4x256": (lambda: GPT(vocab=512, dim=256, heads=4, layers=4, seq=64),
                      lambda g: torch.randint(0, 512, (8, 64), generator=g), _lm_step),
        "mlp-5x2048": (lambda: DummyModel(5, 2048),
                       lambda g: torch.randn(32, 2048, generator=g), _mlp_step),
    }


def _job(rank: int, world: int, steps: int, trace_layers: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import spmd_backend
    from spmd_backend.testing.models import GPT

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    out: dict = {"trace": {}, "step": {}}

    # 1. trace time of the first calls of a deep transformer
    torch.manual_seed(0)
    model = GPT(vocab=512, dim=256, heads=4, layers=trace_layers, seq=64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = spmd_backend.compile()(_lm_step)
    batch = torch.randint(0, 512, (4, 64))
    t0 = time.perf_counter()
    step(model, opt, batch)
    first_call = time.perf_counter() - t0
    first_trace = step.graph.traced.trace_seconds
    t0 = time.perf_counter()
    step(model, opt, batch)
    second_call = time.perf_counter() - t0
    out["trace"] = {
        "layers": trace_layers,
        "nodes": len(step.graph.traced.gm.graph.nodes),
        "first_call_s": first_call,
        "first_trace_s": first_trace,
        "second_call_s": second_call,
        "second_trace_s": step.graph.traced.trace_seconds,
    }

    # 2. steady-state step time, interleaved with DDP
    for name, (build, make_batch, fn) in _workloads().items():
        torch.manual_seed(0)
        model = build()
        ddp = DDP(copy.deepcopy(model))
        opt = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)
        ddp_opt = torch.optim.Adam(ddp.parameters(), lr=1e-4, fused=True)
        step = spmd_backend.compile(parallel_mode=spmd_backend.DataParallel(reduce_op="avg"))(fn)
        gen = torch.Generator().manual_seed(rank)
        times: dict[str, list[float]] = {"ddp": [], "spmd": []}
        for i in range(steps + 3):
            batch = make_batch(gen)
            torch.distributed.barrier()
            t0 = time.perf_counter()
            fn(ddp, ddp_opt, batch)
            t1 = time.perf_counter()
            torch.distributed.barrier()
            t2 = time.perf_counter()
            step(model, opt, batch)
            t3 = time.perf_counter()
            if i >= 3:
                times["ddp"].append(t1 - t0)
                times["spmd"].append(t3 - t2)
        ddp_med = statistics.median(times["ddp"])
        spmd_med = statistics.median(times["spmd"])
        out["step"][name] = {
            "ddp_ms": 1e3 * ddp_med,
            "spmd_ms": 1e3 * spmd_med,
            "ratio": spmd_med / ddp_med,
            "all_reduces": step.graph.expansion.all_reduces,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--trace-layers", type=int, default=12)
    parser.add_argument("--out", default="out/bench_step.json")
    args = parser.parse_args()
    results = run_on_ranks(_job, args.steps, args.trace_layers, world_size=args.ranks, timeout=1800)
    r0 = results[0]
    meta = {
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.python_version()}",
        "torch": torch.__version__,
        "ranks": args.ranks,
        "steps": args.steps,
    }
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps({"meta": meta, "rank0": r0}, indent=2))
    t = r0["trace"]
    print(f"machine: {meta['machine']}, torch {meta['torch']}, {args.ranks} gloo ranks\n")
    print(f"| trace, GPT {t['layers']} layers ({t['nodes']} nodes) | seconds |")
    print("|---|---|")
    print(f"| first call (bootstrap trace + run) | {t['first_call_s']:.2f} |")
    print(f"| first trace alone | {t['first_trace_s']:.2f} |")
    print(f"| second call (steady-state trace + run) | {t['second_call_s']:.2f} |")
    print(f"| second trace alone | {t['second_trace_s']:.2f} |\n")
    print("| workload | DDP eager ms | spmd (no passes) ms | ratio | all_reduces |")
    print("|---|---|---|---|---|")
    for name, s in r0["step"].items():
        print(f"| {name} | {s['ddp_ms']:.1f} | {s['spmd_ms']:.1f} | {s['ratio']:.2f}x | {s['all_reduces']} |")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
