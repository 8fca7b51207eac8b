"""Which hyper-parameters can be lifted as 0-dim float64 graph inputs, per class x impl?

For every candidate slot, LIFTABLE is overridden to lift (lr, slot) (Rprop: the slot only);
the slot's value changes every step (identically on the eager twin). "ok" needs: the trace
succeeds, no retrace (the changed value is an input, not a baked constant) and assert_close
against eager after 10 steps. ITEMxN: the graph holds N `.item()` (_local_scalar_dense) calls.

usage: PYTHONPATH=.:tools .venv/bin/python tools/hyper_survey.py [--only SUBSTR]
"""

from __future__ import annotations

import argparse
import copy
import logging
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from optim_survey import compare, impls, snapshot, step_fn  # noqa: E402

import spmd_backend
from spmd_backend.tracing import hyperparams

CASES = [
    ("SGD", dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01),
     ["momentum", "dampening", "weight_decay"]),
    ("SGD", dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
     ["momentum", "weight_decay"]),
    ("Adam", dict(lr=0.01, weight_decay=0.01), ["betas0", "betas1", "eps", "weight_decay"]),
    ("Adam", dict(lr=0.01, amsgrad=True), ["betas0", "betas1", "eps"]),
    ("AdamW", dict(lr=0.01, weight_decay=0.01), ["betas0", "betas1", "eps", "weight_decay"]),
    ("Adamax", dict(lr=0.01, weight_decay=0.01), ["betas0", "betas1", "eps", "weight_decay"]),
    ("NAdam", dict(lr=0.01, weight_decay=0.01),
     ["betas0", "betas1", "eps", "weight_decay", "momentum_decay"]),
    ("NAdam", dict(lr=0.01, weight_decay=0.01, decoupled_weight_decay=True),
     ["betas0", "betas1", "weight_decay"]),
    ("RAdam", dict(lr=0.01, weight_decay=0.01), ["betas0", "betas1", "eps", "weight_decay"]),
    ("RAdam", dict(lr=0.01, weight_decay=0.01, decoupled_weight_decay=True),
     ["betas0", "betas1", "weight_decay"]),
    ("RMSprop", dict(lr=0.01, weight_decay=0.01), ["alpha", "eps", "weight_decay"]),
    ("RMSprop", dict(lr=0.01, centered=True, momentum=0.9), ["alpha", "eps", "momentum"]),
    ("Adagrad", dict(lr=0.05, lr_decay=0.01, weight_decay=0.01),
     ["lr_decay", "weight_decay", "eps"]),
    ("Adadelta", dict(lr=0.5, weight_decay=0.01), ["rho", "eps", "weight_decay"]),
    ("ASGD", dict(lr=0.01, weight_decay=0.01, t0=2), ["lambd", "alpha", "t0", "weight_decay"]),
    ("Rprop", dict(lr=0.01), ["lr", "etas0", "etas1", "step_sizes0", "step_sizes1", "step_sizes*"]),
    ("Adam", dict(lr=0.01), ["betas*"]),
    ("AdamW", dict(lr=0.01), ["betas*"]),
]


def parse(slot: str) -> list[tuple[str, int | None]]:
    """"betas0" -> [("betas", 0)]; "betas*" -> both elements; "eps" -> [("eps", None)]."""
    if slot.endswith("*"):
        return [(slot[:-1], 0), (slot[:-1], 1)]
    if slot[-1].isdigit() and slot[:-1] in ("betas", "etas", "step_sizes"):
        return [(slot[:-1], int(slot[-1]))]
    return [(slot, None)]


def bump(opt: torch.optim.Optimizer, slot: tuple[str, int | None], i: int) -> None:
    """Change the slot a little each step (and lr, which is lifted here except for Rprop)."""
    key, idx = slot
    for g in opt.param_groups:
        if key != "lr" and not isinstance(opt, torch.optim.Rprop):
            g["lr"] = g["lr"] * 0.97
        if idx is None:
            g[key] = g[key] * (1 - 0.03 * i) if key != "t0" else g[key] + 1
        else:
            items = list(g[key])
            if key == "betas":
                items[idx] = items[idx] - (0.02 if idx == 0 else 0.001) * i
            elif key == "etas":
                items[idx] = items[idx] + (-0.01 if idx == 0 else 0.01) * i
            else:
                items[idx] = items[idx] * (1 + 0.1 * i) if idx == 0 else items[idx] - i
            g[key] = tuple(items)


def where(e: BaseException) -> str:
    """file:line and source of the innermost torch/optim frame that raised."""
    import linecache
    import traceback

    while e.__cause__ is not None:
        e = e.__cause__
    hit = ""
    for fr in traceback.extract_tb(e.__traceback__):
        if "torch/optim/" in fr.filename:
            src = linecache.getline(fr.filename, fr.lineno).strip()
            hit = f"[{fr.filename.split('torch/optim/')[1]}:{fr.lineno} `{src[:70]}`]"
    return hit


def run(name, kw, ikw, impl, slots, steps) -> str:
    cls = getattr(torch.optim, name)
    saved = dict(hyperparams.LIFTABLE[name])
    base = set() if name == "Rprop" else {("lr", None)}  # Rprop reads lr only at state creation
    hyperparams.LIFTABLE[name][impl] = tuple(hyperparams.Lift(k, i) for k, i in base | set(slots))
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        twin = copy.deepcopy(model)
        opt = cls(model.parameters(), **kw, **ikw)
        ref = cls(twin.parameters(), **kw, **ikw)
        xs = [torch.randn(6, 8) for _ in range(steps)]
        compiled = spmd_backend.compile(max_graphs=32)(step_fn)
        graphs_after_2 = None
        for i, x in enumerate(xs):
            if i >= 1:
                for slot in slots:
                    bump(opt, slot, i)
                    bump(ref, slot, i)
            step_fn(twin, ref, x)
            try:
                compiled(model, opt, x)
            except Exception as e:  # noqa: BLE001
                return f"FAIL@{i + 1} {where(e)} {' '.join(str(e).split())[:150]}"
            if i == 1:
                graphs_after_2 = compiled.cache_size()
        retraced = compiled.cache_size() != graphs_after_2
        items = sum(
            n.target is torch.ops.aten._local_scalar_dense.default
            for n in compiled.graph.traced.gm.graph.nodes
        )
        try:
            worst, bitwise = compare(snapshot(twin, ref), snapshot(model, opt))
        except AssertionError as e:
            return "MISMATCH " + " ".join(str(e).split())[:160]
        tag = ("RETRACED " if retraced else "") + (f"ITEMx{items} " if items else "")
        return f"{tag}ok {worst:.1e} {'bitwise' if bitwise else ''}"
    finally:
        hyperparams.LIFTABLE[name].clear()
        hyperparams.LIFTABLE[name].update(saved)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29535")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        for name, kw, slots in CASES:
            cls = getattr(torch.optim, name)
            for impl, ikw in impls(cls):
                if impl == "default":
                    continue  # the same as fused (fused-capable classes) or single
                for s in ["lr"] + [x for x in slots if x != "lr"]:
                    label = f"{name}({', '.join(f'{k}={v}' for k, v in kw.items())}) [{impl}] {s}"
                    if a.only and a.only not in label:
                        continue
                    res = run(name, kw, ikw, impl, parse(s), a.steps)
                    print(f"{label:95s} {res}", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
