"""Benchmark: the pass manager's own overhead and IterGraphModule cost vs graph size.

    python tools/bench_pass_manager.py [--sizes 12500 25000 50000]

Builds synthetic train-step-shaped graphs (chains of aten ops with fake values, phase
annotations, all_reduce + wait pairs and copy_ write-backs) of each size and measures, per size:
a no-op pass run through the PassManager (lint, DCE, SPMD verification, recompile -- lazy: code
is generated when the graph first runs), the same with verification off, IterGraphModule
construction, a move_to_next_iter_before, finalize_setup (deriving setup/main/cleanup), and the
first use of the main graph (deriving it and generating its Python code). Prints a markdown table
with the growth factor from the smallest size; linear growth means 4x from 12.5k to 50k.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from spmd_backend.graph.meta import Phase, annotate  # noqa: E402
from spmd_backend.graph.utils import make_graph_module  # noqa: E402
from spmd_backend.iter_graph_module import IterGraphModule  # noqa: E402
from spmd_backend.pass_manager import PassManager, declare_pass  # noqa: E402

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def build(n_nodes: int) -> fx.GraphModule:
    """~n_nodes nodes: per 'layer' a forward op, a backward op, an all_reduce + wait, an update."""
    with FakeTensorMode():
        val = torch.empty(8)
    g = fx.Graph()
    per_layer = 7
    layers = max(1, n_nodes // per_layer)
    params = []
    x = g.placeholder("x")
    x.meta["val"] = val
    annotate(x, fqn=None, phase=Phase.INPUT)
    for i in range(layers):
        p = g.placeholder(f"p{i}")
        p.meta["val"] = val
        annotate(p, fqn=f"l{i}", phase=Phase.INPUT)
        params.append(p)
    h = x
    fwd = []
    for p in params:
        h = g.call_function(aten.mul.Tensor, (h, p))
        fwd.append(h)
    grads = []
    for f in fwd:
        gr = g.call_function(aten.add.Tensor, (f, 1.0))
        ar = g.call_function(c10d.all_reduce.default, (gr, "sum", "0"))
        w = g.call_function(c10d.wait_tensor.default, (ar,))
        grads.append(w)
    for p, gr in zip(params, grads):
        new = g.call_function(aten.sub.Tensor, (p, gr))
        g.call_function(aten.copy_.default, (p, new))
    out = g.output([h])
    for node in g.nodes:
        if node.op == "call_function":
            node.meta["val"] = val
            phase = Phase.COMM if node.target in (c10d.all_reduce.default, c10d.wait_tensor.default) else Phase.FORWARD
            annotate(node, fqn="l", phase=phase)
    annotate(out, fqn=None, phase=Phase.OUTPUT)
    return make_graph_module(torch.nn.Module(), g)


def noop(gm: fx.GraphModule) -> None:
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[12500, 25000, 50000])
    args = parser.parse_args()
    spec = declare_pass(noop, name="bench_noop")
    rows = []
    for size in args.sizes:
        gm = build(size)
        nodes = len(gm.graph.nodes)
        t0 = time.perf_counter()
        PassManager([spec]).run(gm)
        pm = time.perf_counter() - t0
        t0 = time.perf_counter()
        PassManager([spec], verify=False).run(gm)
        pm_noverify = time.perf_counter() - t0
        t0 = time.perf_counter()
        igm = IterGraphModule(gm)
        construct = time.perf_counter() - t0
        copies = [n for n in igm.graph.nodes if n.target is aten.copy_.default]
        last = copies[-1]
        block = [last.args[1], last]
        first_use = next(iter(sorted(last.args[0].users, key=lambda u: 0)))
        t0 = time.perf_counter()
        igm.graph.move_to_next_iter_before(block, first_use)
        move = time.perf_counter() - t0
        t0 = time.perf_counter()
        igm.finalize_setup()
        finalize = time.perf_counter() - t0
        t0 = time.perf_counter()
        igm.main_gm.real_recompile()
        codegen = time.perf_counter() - t0
        rows.append((size, nodes, pm, pm_noverify, construct, move, finalize, codegen))
    base = rows[0]
    print("| nodes | PassManager, one no-op pass s | (no verify) s | IterGraphModule() s | "
          "move s | finalize_setup s | first use of main: derive + codegen s | growth: manager / first use |")
    print("|---|---|---|---|---|---|---|---|")
    for _size, nodes, pm, pmv, c, mv, fin, cg in rows:
        print(f"| {nodes} | {pm:.2f} | {pmv:.2f} | {c:.5f} | {mv:.3f} | {fin:.2f} | {cg:.2f} | "
              f"{pm / base[2]:.1f}x / {cg / base[7]:.1f}x |")


if __name__ == "__main__":
    main()
