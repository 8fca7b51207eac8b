"""Print the per-module, per-phase report of a traced train step.

    python tools/report.py [--model gpt|mlp|batchnorm|...] [--optimized] [--checkpoint FQN]

Traces one step of a registered model (spmd_backend.testing.models) in one process under a fake
process group of world size 2 (no communication happens), optionally runs the graph-optimization
passes, and prints :func:`spmd_backend.report.step_report`.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import spmd_backend  # noqa: E402
from spmd_backend.gm_transformation import GraphModuleTransformation  # noqa: E402
from spmd_backend.report import step_report  # noqa: E402
from spmd_backend.testing import fake_process_group  # noqa: E402
from spmd_backend.testing.models import MODELS  # noqa: E402
from spmd_backend.testing.parity import make_train_step  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt", choices=sorted(MODELS))
    parser.add_argument("--optimized", action="store_true", help="run the graph-optimization passes")
    parser.add_argument("--checkpoint", action="append", default=[], help="checkpoint this submodule")
    args = parser.parse_args()
    entry = MODELS[args.model]
    torch.manual_seed(0)
    model = entry.build()
    for fqn in args.checkpoint:
        spmd_backend.checkpoint(model.get_submodule(fqn))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    transformation = GraphModuleTransformation(enable_graph_optimization=True) if args.optimized else None
    with fake_process_group(world_size=2):
        step = spmd_backend.compile(gm_transformation=transformation)(make_train_step(entry))
        gen = torch.Generator().manual_seed(0)
        for _ in range(2):  # the first call may be the optimizer-state bootstrap
            step(model, optim, entry.batch(gen))
        graph_holder = step.compiled if step.compiled is not None else step.graph.traced.gm
        print(step_report(graph_holder))


if __name__ == "__main__":
    main()
