"""Pictures of a training step on 2 ranks: timeline PNG (before/after the passes), graph SVG,
per-bucket table.

    python tools/viz.py [--out out/viz] [--model mlp|gpt]

Trains the seed's DummyModel (or the small GPT) on 2 loopback gloo ranks with and without the
graph-optimization passes, profiles one steady-state step of each, and writes (rank 0):
``timeline.png`` (compute lane and collectives in flight, before vs after), ``graph.svg`` (the
optimized step graph, rows by module, coloured by phase) and ``buckets.md`` (which parameters,
bytes, where issued and waited, time in flight).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from spmd_backend.testing import run_on_ranks  # noqa: E402


def _job(rank: int, world: int, out_dir: str, model_name: str) -> list[str]:
    import spmd_backend
    from spmd_backend.gm_transformation import GraphModuleTransformation
    from spmd_backend.testing.models import GPT, MODELS, DummyModel
    from spmd_backend.testing.parity import make_train_step
    from spmd_backend.viz import bucket_table, graph_svg, profile_step, timeline_png

    torch.set_num_threads(1)
    if model_name == "gpt":
        entry = MODELS["gpt"]
        build = lambda: GPT(vocab=512, dim=256, heads=4, layers=4, seq=64)  # noqa: E731
        make_batch = lambda g: torch.randint(0, 512, (8, 64), generator=g)  # noqa: E731
    else:
        entry = MODELS["dummy"]
        build = lambda: DummyModel(3, 1024)  # noqa: E731
        make_batch = lambda g: torch.randn(32, 1024, generator=g)  # noqa: E731
    step_fn = make_train_step(entry)
    gen = torch.Generator().manual_seed(rank)
    timelines = []
    optimized = None
    for label, transformation in (
        ("no passes", None),
        ("graph optimization", GraphModuleTransformation(enable_graph_optimization=True, bucket_size_mb=4)),
    ):
        torch.manual_seed(0)
        model = build()
        opt = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)
        step = spmd_backend.compile(gm_transformation=transformation)(step_fn)
        batch = make_batch(gen)
        for _ in range(3):
            step(model, opt, batch)
        torch.distributed.barrier()
        timelines.append(profile_step(lambda s=step, m=model, o=opt, b=batch: s(m, o, b), label))
        optimized = step
    if rank != 0:
        return []
    os.makedirs(out_dir, exist_ok=True)
    png = timeline_png(timelines, os.path.join(out_dir, "timeline.png"))
    graph = optimized.compiled.graph
    svg = graph_svg(graph, os.path.join(out_dir, "graph.svg"))
    table = os.path.join(out_dir, "buckets.md")
    with open(table, "w") as f:
        f.write(bucket_table(graph, timelines[-1]) + "\n")
    return [png, svg, table]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/viz")
    parser.add_argument("--model", default="mlp", choices=["mlp", "gpt"])
    args = parser.parse_args()
    paths = run_on_ranks(_job, str(pathlib.Path(args.out).resolve()), args.model, world_size=2, timeout=900)[0]
    print("\n".join(f"wrote {p}" for p in paths))
    print(pathlib.Path(paths[-1]).read_text())


if __name__ == "__main__":
    main()
