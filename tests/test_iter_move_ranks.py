"""IterGraphModule on a traced 2-rank train step: move one gradient all_reduce and its
optimizer update into the next iteration; parameters must equal the unmoved run."""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = pytest.mark.multirank


def move_last_layer_update(gm):
    from spmd_backend.graph import ops
    from spmd_backend.graph.meta import Phase, get_phase
    from spmd_backend.graph.utils import add_exclusive_inputs, find_all_descendants
    from spmd_backend.iter_graph_module import IterGraphModule

    igm = IterGraphModule(gm)
    graph = igm.graph
    param = next(n for n in graph.nodes if n.op == "placeholder" and n.name == "p_layers_2_weight")
    order = {n: i for i, n in enumerate(graph.nodes)}
    first_use = min(param.users, key=order.__getitem__)
    for ar in (n for n in graph.nodes if ops.is_all_reduce(n)):
        block = find_all_descendants(graph, [ar])
        if any(ops.is_copy_(n) and n.args[0] is param for n in block):
            # complete the update with optimizer work that does not depend on the gradient
            block = add_exclusive_inputs(graph, block, lambda n: get_phase(n) is Phase.OPTIMIZER)
            break
    else:
        raise AssertionError("no all_reduce feeds the update of layers.2.weight")
    graph.move_to_next_iter_before(block, first_use)
    igm.finalize_setup()
    return igm


def _iter_move_job(rank: int, world_size: int, momentum: float, flush_at: int | None) -> dict:
    import spmd_backend
    from spmd_backend.testing.models import MODELS
    from spmd_backend.testing.parity import make_train_step

    entry = MODELS["mlp"]
    torch.manual_seed(0)
    model = entry.build()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum, foreach=False)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=momentum, foreach=False)
    moved = spmd_backend.compile(gm_transformation=move_last_layer_update)(make_train_step(entry))
    plain = spmd_backend.compile()(make_train_step(entry))
    gen = torch.Generator().manual_seed(rank)
    steps = 6
    pending = []
    for i in range(steps):
        batch = entry.batch(gen)
        last = {"last_train_step": True} if i == steps - 1 else {}
        moved(model, opt, batch, **last)
        plain(ref, ref_opt, batch)
        igm = moved.compiled
        pending.append(igm.pending_moves if igm is not None else 0)
        if flush_at == i:
            igm.flush()
            pending[-1] = igm.pending_moves
            for p, q in zip(model.parameters(), ref.parameters()):
                torch.testing.assert_close(p, q, msg=lambda m, i=i: f"after flush at step {i}: {m}")
            torch.testing.assert_close(opt.state_dict()["state"], ref_opt.state_dict()["state"])
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, msg=lambda m, name=name: f"{name}: {m}")
    return {"pending": pending, "moves": moved.compiled.num_moves}


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_moved_update_matches_unmoved_run(rank_pool, momentum):
    results = rank_pool.run(_iter_move_job, momentum, None)
    pending = results[0]["pending"]
    assert results[0]["moves"] == 1
    # momentum creates state: the first call is the untransformed bootstrap graph
    first_transformed = 1 if momentum else 0
    assert pending[first_transformed:-1] == [1] * (len(pending) - 1 - first_transformed)
    assert pending[-1] == 0, "last_train_step must leave nothing pending"


def test_flush_mid_run_loses_nothing(rank_pool):
    results = rank_pool.run(_iter_move_job, 0.9, 3)
    assert results[0]["pending"][3] == 0
