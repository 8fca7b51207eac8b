"""Every pass of spmd_backend.passes is a plain function without hidden state.

Each case applies passes by calling them directly (no PassManager, no seed wrapper) to two
freshly traced graphs in a row, in both orders where the order is free, without clearing
anything in between: both graphs must be rewritten (not silently skipped), satisfy the SPMD
invariants and train exactly like the untransformed step. A pass that kept process-wide state
(as the seed's ``_optimized_func`` record does) fails on the second graph.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import Net, assert_same_training, run_pair

from spmd_backend.graph import ops
from spmd_backend.graph.invariants import verify_graph
from spmd_backend.graph.optim import get_optimizer_blocks
from spmd_backend.iter_graph_module import IterGraphModule
from spmd_backend.passes import (
    ModuleTarget,
    comm_fusion_with_concat,
    get_all_fused_optimizer_blocks,
    iter_move_grads_and_optimizers,
    remove_copy_from_optimizer,
    schedule_comm_wait,
    split_fused_optimizer,
)

aten = torch.ops.aten

Step = tuple[Callable[..., Any], tuple]
FUSE: Step = (comm_fusion_with_concat, (0.9,))
SCHEDULE: Step = (schedule_comm_wait, ())
REINPLACE: Step = (remove_copy_from_optimizer, ())
MOVE: Step = (iter_move_grads_and_optimizers, (ModuleTarget("layers.2"), ModuleTarget("layers.2")))


def wide() -> Net:
    return Net(dims=(16, 512, 512, 512, 8))  # 1 MiB weights: several buckets at 0.9 MiB


def split_first_two(igm: IterGraphModule) -> None:
    (block,) = get_all_fused_optimizer_blocks(igm, "_fused_adam")
    grads = block.optim.optim_node.args[1]
    split_fused_optimizer(igm, block, {grads[0], grads[1]})


SPLIT: Step = (split_first_two, ())


def facts(igm: IterGraphModule) -> dict[str, Any]:
    """What the passes are expected to have done to a graph."""
    graph = igm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    reduces = [n for n in graph.nodes if ops.is_all_reduce(n)]
    mms = [n for n in graph.nodes if n.target is aten.mm.default]
    first_wait = next(iter(reduces[0].users)) if reduces else None
    return {
        "all_reduces": len(reduces),
        "fused": all(n.args[0].target is aten.cat.default for n in reduces),
        "overlapped": bool(reduces) and order[reduces[0]] < order[mms[-1]] < order[first_wait],
        "in_place_adam": any(n.target is aten._fused_adam_.tensor_lr for n in graph.nodes),
        "optimizer_blocks": len(get_optimizer_blocks(graph)),
        "moves": igm.num_moves,
    }


def applying(steps: list[Step], seen: list[dict[str, Any]]) -> Callable[[Any], IterGraphModule]:
    def transformation(gm: Any) -> IterGraphModule:
        igm = IterGraphModule(gm)
        for fn, args in steps:
            fn(igm, *args)
        verify_graph(igm.graph)  # lint, one wait per collective, fake values, annotations
        seen.append(facts(igm))
        igm.finalize_setup()
        return igm

    return transformation


def twice(passes: list[Step], **run_kwargs: Any) -> list[dict[str, Any]]:
    """Apply ``passes`` to two freshly traced steps in a row; both must train like eager."""
    seen: list[dict[str, Any]] = []
    graphs = []
    for _ in range(2):
        compiled, model, ref = run_pair(applying(passes, seen), **run_kwargs)
        assert_same_training(model, ref)
        graphs.append(compiled.compiled.graph)
    assert graphs[0] is not graphs[1] and len(seen) == 2
    assert seen[0] == seen[1], "the second graph was rewritten differently from the first"
    return seen


@pytest.mark.parametrize(
    "steps,overlapped",
    [([FUSE, SCHEDULE, REINPLACE], True), ([REINPLACE, SCHEDULE, FUSE], False)],
    ids=["fuse-schedule-reinplace", "reinplace-schedule-fuse"],
)
def test_comm_and_optimizer_passes_on_two_graphs(fake_pg, steps, overlapped):
    seen = twice(steps, model_factory=wide)
    # 8 gradients in readiness order: [out, layers.2] closes at 1 MiB, [layers.1] at 0.9 MiB,
    # [layers.0] ends the plan
    assert seen[0]["all_reduces"] == 3 and seen[0]["fused"] and seen[0]["in_place_adam"]
    # scheduling before bucketing is valid, but the buckets then wait where they are built
    assert seen[0]["overlapped"] is overlapped


@pytest.mark.parametrize(
    "steps", [[REINPLACE, SPLIT], [SPLIT, REINPLACE]], ids=["reinplace-split", "split-reinplace"]
)
def test_split_fused_optimizer_on_two_graphs(fake_pg, steps):
    seen = twice(steps)
    assert seen[0]["optimizer_blocks"] == 2 and seen[0]["in_place_adam"]


@pytest.mark.parametrize(
    "steps",
    [[FUSE, SCHEDULE, REINPLACE, MOVE], [REINPLACE, FUSE, MOVE]],
    ids=["with-schedule", "without-schedule"],
)
def test_iter_move_on_two_graphs(fake_pg, steps):
    seen = twice(steps, model_factory=wide, steps=5)
    assert seen[0]["moves"] == 1


def test_a_second_application_is_a_logged_noop(fake_pg, caplog):
    seen: list[dict[str, Any]] = []
    again = [FUSE, REINPLACE, FUSE, REINPLACE]
    with caplog.at_level(logging.INFO, logger="spmd_backend.passes"):
        compiled, model, ref = run_pair(applying(again, seen), model_factory=wide)
    assert_same_training(model, ref)
    assert seen[0]["all_reduces"] == 3
    messages = [r.getMessage() for r in caplog.records]
    assert any("comm_fusion_with_concat: no unfused gradient collective" in m for m in messages)
    assert any("remove_copy_from_optimizer: no functional optimizer op" in m for m in messages)
