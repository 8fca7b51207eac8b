"""Survey: every torch.optim optimizer x implementation, compiled vs eager (1-rank gloo).

usage: PYTHONPATH=.:tools .venv/bin/python tools/optim_survey.py [--opt] [--steps N]
       [--only SUBSTR] [--sched]
--opt: GraphModuleTransformation(enable_graph_optimization=True); --sched: OneCycleLR-style
changes of every lifted hyper-parameter between steps (applied identically to both twins; a
retrace is reported).
"""

from __future__ import annotations

import argparse
import copy
import inspect
import logging
import os
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn

import spmd_backend
from spmd_backend.gm_transformation import GraphModuleTransformation

CASES = [
    ("SGD", dict(lr=0.05)),
    ("SGD", dict(lr=0.05, momentum=0.9)),
    ("SGD", dict(lr=0.05, momentum=0.9, nesterov=True)),
    ("SGD", dict(lr=0.05, momentum=0.9, dampening=0.3)),
    ("SGD", dict(lr=0.05, momentum=0.9, weight_decay=0.1, maximize=True)),
    ("Adam", dict(lr=0.01)),
    ("Adam", dict(lr=0.01, amsgrad=True, weight_decay=0.1)),
    ("Adam", dict(lr=0.01, maximize=True)),
    ("AdamW", dict(lr=0.01)),
    ("AdamW", dict(lr=0.01, maximize=True, amsgrad=True)),
    ("Adamax", dict(lr=0.01, weight_decay=0.1)),
    ("NAdam", dict(lr=0.01, weight_decay=0.1)),
    ("NAdam", dict(lr=0.01, weight_decay=0.1, decoupled_weight_decay=True)),
    ("RAdam", dict(lr=0.01, weight_decay=0.1)),
    ("RAdam", dict(lr=0.01, weight_decay=0.1, decoupled_weight_decay=True)),
    ("RMSprop", dict(lr=0.01, weight_decay=0.1)),
    ("RMSprop", dict(lr=0.01, centered=True, momentum=0.9)),
    ("Adagrad", dict(lr=0.05, lr_decay=0.01, weight_decay=0.1)),
    ("Adadelta", dict(lr=0.5, weight_decay=0.1)),
    ("ASGD", dict(lr=0.01, weight_decay=0.1, t0=2)),
    ("Rprop", dict(lr=0.01)),
]


def impls(cls: type) -> list[tuple[str, dict]]:
    params = inspect.signature(cls.__init__).parameters
    out = [("default", {}), ("foreach", dict(foreach=True)), ("single", dict(foreach=False))]
    if "fused" in params:
        out.append(("fused", dict(fused=True)))
    return out


def step_fn(model, optim, x):
    loss = model(x).pow(2).mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def schedule(opt: torch.optim.Optimizer, i: int) -> None:
    """Change every hyper-parameter the tracer lifts a little (a scheduler's job)."""
    from spmd_backend.tracing.hyperparams import install, lifted_slots, slot_value

    for slot in lifted_slots(opt):
        _, key, idx = slot
        v = slot_value(opt, slot)
        if key == "betas":
            new = v - (0.02 if idx == 0 else 0.001)
        elif key == "step_sizes":
            new = v * 1.1 if idx == 0 else v - 1
        elif key == "t0":
            new = v + 1
        else:
            new = v * 0.97
        install(opt.param_groups[slot[0]], slot, new)


def compare(a: dict, b: dict) -> tuple[float, bool]:
    worst, bitwise = 0.0, True
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            torch.testing.assert_close(y, x, msg=lambda m, k=k: f"{k}: {m}")
            d = (x.double() - y.double()).abs().max().item() if x.numel() else 0.0
            worst = max(worst, d)
            bitwise &= bool(torch.equal(x, y))
        else:
            assert x == y, f"{k}: {x!r} != {y!r}"
    return worst, bitwise


def snapshot(model, opt) -> dict:
    out = {f"p.{n}": p.detach().clone() for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            out[f"s.{names[id(p)]}.{k}"] = v.detach().clone() if isinstance(v, torch.Tensor) else v
    return out


def run_case(name, kw, impl_kw, *, graph_opt, steps, sched) -> str:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    twin = copy.deepcopy(model)
    cls = getattr(torch.optim, name)
    opt = cls(model.parameters(), **kw, **impl_kw)
    ref = cls(twin.parameters(), **kw, **impl_kw)
    xs = [torch.randn(6, 8) for _ in range(steps)]
    tf = GraphModuleTransformation(enable_graph_optimization=True) if graph_opt else None
    compiled = spmd_backend.compile(gm_transformation=tf, max_graphs=16)(step_fn)
    graphs_after_2 = None
    for i, x in enumerate(xs):
        if i == 2:
            graphs_after_2 = compiled.cache_size()
        if sched and i >= 1:
            schedule(opt, i)
            schedule(ref, i)
        step_fn(twin, ref, x)
        try:
            compiled(model, opt, x)
        except Exception as e:  # noqa: BLE001
            msg = str(e).splitlines()[0][:230]
            return f"FAIL@step{i + 1} {type(e).__name__}: {msg}"
    try:
        worst, bitwise = compare(snapshot(twin, ref), snapshot(model, opt))
    except AssertionError as e:
        return "MISMATCH " + " ".join(str(e).split())[:230]
    retraced = graphs_after_2 is not None and compiled.cache_size() != graphs_after_2
    return (f"ok max|d|={worst:.1e} {'bitwise' if bitwise else 'not-bitwise'}"
            f"{' RETRACED' if retraced else ''}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--opt", action="store_true")
    ap.add_argument("--sched", action="store_true")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--only", default="")
    ap.add_argument("--tb", action="store_true")
    a = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        for name, kw in CASES:
            for impl, ikw in impls(getattr(torch.optim, name)):
                label = f"{name}({', '.join(f'{k}={v}' for k, v in kw.items())}) [{impl}]"
                if a.only and a.only not in label:
                    continue
                try:
                    res = run_case(name, kw, ikw, graph_opt=a.opt, steps=a.steps, sched=a.sched)
                except Exception as e:  # noqa: BLE001
                    res = f"EAGER-ERROR {type(e).__name__}: {str(e)[:200]}"
                    if a.tb:
                        traceback.print_exc()
                print(f"{label:80s} {res}", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
