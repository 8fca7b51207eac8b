"""Sharded optimizer state against DDP for every shardable torch.optim optimizer, both doors.

On 2 gloo ranks, each case trains a small MLP (uneven layer sizes, a frozen layer, two param
groups with different learning rates, a LambdaLR scheduler stepping every call) for 6 steps with
``DataParallel(shard_optimizer=True)`` (``--door compile``) or ``torch.compile(step,
backend="spmd", options={"shard_optimizer": True})`` (``--door dynamo``), next to DDP with the
same optimizer; after the third call it waits for the background compile, so the last calls
run Inductor's code where the door lowers with Inductor (the Dynamo door by default). It prints, per optimizer x implementation, the largest parameter and state
difference (the full state through ``state_dict()``, every key compared, non-tensor entries
equal), and that the full state loads into a plain optimizer. ``--background 0`` compiles with
Inductor before the first call. Anything above 1e-5 is a failure.

usage: .venv/bin/python tools/shard_survey.py --door dynamo [--only ASGD Rprop]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from typing import Any

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

CASES: list[tuple[str, dict[str, Any]]] = [
    ("SGD", dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.1)),
    ("Adam", dict(lr=0.01, amsgrad=True, weight_decay=0.1)),
    ("AdamW", dict(lr=0.01, maximize=True, amsgrad=True)),
    ("Adamax", dict(lr=0.01, weight_decay=0.1)),
    ("NAdam", dict(lr=0.01, weight_decay=0.1)),
    ("RAdam", dict(lr=0.01, weight_decay=0.1)),
    ("RMSprop", dict(lr=0.01, weight_decay=0.1, momentum=0.9, centered=True)),
    ("Adagrad", dict(lr=0.05, lr_decay=0.01, weight_decay=0.1)),
    ("Adadelta", dict(lr=0.5, weight_decay=0.1)),
    ("ASGD", dict(lr=0.01, weight_decay=0.1, t0=2.0)),
    ("Rprop", dict(lr=0.01)),
]
TOLERANCE = 1e-5


def _optimizer(cls: type, kw: dict[str, Any], model: nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return cls([{"params": params[:2]}, {"params": params[2:], "lr": kw["lr"] * 0.5}], **kw)


def _state_diff(ours: dict, theirs: dict) -> float:
    worst = 0.0
    for i, entries in theirs["state"].items():
        for key, ref in entries.items():
            mine = ours["state"][i][key]
            if torch.is_tensor(ref):
                if mine.shape != ref.shape:
                    raise AssertionError(f"state {i}.{key}: shape {tuple(mine.shape)} != {tuple(ref.shape)}")
                worst = max(worst, float((mine.double() - ref.double()).abs().max()))
            elif mine != ref:
                raise AssertionError(f"state {i}.{key}: {mine!r} != {ref!r}")
    return worst


def _job(rank: int, world: int, only: list[str], door: str) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import spmd_backend
    from spmd_backend.lowering import wait_for_background
    from spmd_backend.testing.steps import train_step as step

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 13), nn.ReLU(), nn.Linear(13, 5), nn.Linear(5, 3))
    base[2].weight.requires_grad_(False)
    gen = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randn(4, 8, generator=gen) for _ in range(6)]

    out: dict[str, Any] = {}
    for name, kw in CASES:
        if only and name not in only:
            continue
        cls = getattr(torch.optim, name)
        for impl in ("single", "foreach"):
            label = f"{name}-{impl}"
            try:
                kw_impl = dict(kw, foreach=impl == "foreach")
                model, ref = copy.deepcopy(base), copy.deepcopy(base)
                opt, ref_opt = _optimizer(cls, kw_impl, model), _optimizer(cls, kw_impl, ref)
                scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda i: 0.9 ** i) for o in (opt, ref_opt)]
                ddp = DDP(ref)
                if door == "compile":
                    mode = spmd_backend.DataParallel(reduce_op="avg", shard_optimizer=True)
                    compiled = spmd_backend.compile(parallel_mode=mode)(step)
                else:
                    torch._dynamo.reset()
                    compiled = torch.compile(step, backend="spmd", options={"shard_optimizer": True})
                for i, x in enumerate(batches):
                    compiled(model, opt, x)
                    step(ddp, ref_opt, x)
                    for s in scheds:
                        s.step()
                    if i == 2:  # Inductor's code (the worker's) runs the last calls
                        wait_for_background(timeout=900)
                params = max(float((p.detach() - q.detach()).abs().max())
                             for p, q in zip(model.parameters(), ref.parameters()))
                full = opt.state_dict()
                state = _state_diff(full, ref_opt.state_dict())
                _optimizer(cls, kw_impl, copy.deepcopy(base)).load_state_dict(full)
                out[label] = (params, state)
            except Exception as e:  # noqa: BLE001 - reported per case
                out[label] = f"{type(e).__name__}: {str(e)[:200]}"
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--door", choices=["compile", "dynamo"], default="compile")
    parser.add_argument("--only", nargs="*", default=[])
    parser.add_argument("--background", choices=["0", "1"], default=None,
                        help="SPMD_BACKEND_BACKGROUND_COMPILE for the ranks (default: as set)")
    args = parser.parse_args()
    from spmd_backend.testing import run_on_ranks

    env = {"SPMD_BACKEND_BACKGROUND_COMPILE": args.background} if args.background else None
    results = run_on_ranks(_job, args.only, args.door, world_size=2, timeout=3000, env=env)
    failed = 0
    print(f"| {args.door} door | max parameter diff | max state diff | result |")
    print("|---|---|---|---|")
    for label in results[0]:
        per_rank = [r[label] for r in results]
        if any(isinstance(v, str) for v in per_rank):
            failed += 1
            print(f"| {label} | - | - | {next(v for v in per_rank if isinstance(v, str))} |")
            continue
        params = max(v[0] for v in per_rank)
        state = max(v[1] for v in per_rank)
        ok = params <= TOLERANCE and state <= TOLERANCE
        failed += not ok
        print(f"| {label} | {params:.1e} | {state:.1e} | {'ok' if ok else 'DIFFERS'} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
