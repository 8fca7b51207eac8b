"""End-to-end parity with DDP on 2 gloo ranks: every optimizer configuration on the MLP, every
model with two of them.

Each case trains 10 steps on rank-dependent batches and compares parameters, buffers and
optimizer state (``torch.testing.assert_close`` fp32 tolerances). A negative control shows the
check fails when the gradient collectives are removed. (Every torch.optim optimizer x
implementation against eager is tests/test_optimizers.py; third-party models are
tests/test_third_party.py.)
"""

from __future__ import annotations

import pytest
import torch

from spmd_backend.testing import OptimSpec, ParityCase, check_ddp_parity
from spmd_backend.testing.parity import without_gradient_collectives

pytestmark = pytest.mark.multirank

OPTIMIZERS = [
    OptimSpec("sgd", "single"),
    OptimSpec("sgd", "foreach", momentum=0.9),
    OptimSpec("sgd", "fused", momentum=0.9, nesterov=True, weight_decay=0.01),
    OptimSpec("sgd", "single", momentum=0.9, weight_decay=0.01, param_groups=2, scheduler=True),
    OptimSpec("adam", "foreach"),
    OptimSpec("adam", "single", capturable=True),
    OptimSpec("adam", "fused", capturable=True),
    OptimSpec("adam", "foreach", capturable=True, weight_decay=0.01),
    OptimSpec("adamw", "foreach", weight_decay=0.1, param_groups=2, scheduler=True),
    OptimSpec("adamw", "fused", weight_decay=0.1, param_groups=2, scheduler=True),
    OptimSpec("adamw", "single", weight_decay=0.1),
]
MODELS = ["gpt", "batchnorm", "unused", "frozen"]
CASES = [("mlp", o) for o in OPTIMIZERS] + [
    (m, o) for m in MODELS for o in (OPTIMIZERS[1], OPTIMIZERS[9])  # sgd-momentum, adamw-fused
]


@pytest.mark.parametrize(
    "model,optim", CASES, ids=[f"{m}-{o.label()}" for m, o in CASES]
)
def test_parity_sum(rank_pool, model, optim):
    results = rank_pool.run(check_ddp_parity, ParityCase(model, optim))
    assert results[0].traces >= 1
    assert results[0].losses[0] != results[0].losses[-1], "the model did not train"


@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_parity_avg(rank_pool, model):
    rank_pool.run(check_ddp_parity, ParityCase(model, OptimSpec("adam", "fused"), reduce_op="avg"))


@pytest.mark.parametrize("shard_optimizer", [False, True], ids=["exact", "sharded"])
def test_parity_zero_grad_first(rank_pool, shard_optimizer):
    """``optim.zero_grad()`` before the forward, as most training loops write it: the
    gradients outlive the step and must equal DDP's too (compared by check_ddp_parity)."""
    case = ParityCase("mlp", OptimSpec("adam", "foreach"), steps=4, reduce_op="avg",
                      zero_grad_first=True, shard_optimizer=shard_optimizer)
    results = rank_pool.run(check_ddp_parity, case)
    assert results[0].losses[0] != results[0].losses[-1], "the model did not train"


def _alone(inductor: bool):
    """The default passes with every gradient of >= 1 KiB reduced alone (default: 4 MiB)."""
    import dataclasses

    from spmd_backend.gm_transformation import GraphModuleTransformation
    from spmd_backend.passes import comm_fusion_with_concat, default_pipeline

    t = GraphModuleTransformation(enable_graph_optimization=True, enable_inductor=inductor)
    t.config = dataclasses.replace(t.config, passes=(
        (comm_fusion_with_concat, {"bucket_size_mb": 25, "standalone_mb": 1 / 1024}),
        *default_pipeline(25)[1:]))
    return t


ALONE = [
    # the fx graph: the mean after the sum is DDP's number bit for bit (SGD is elementwise)
    ("hf_gpt2", OptimSpec("sgd", "single", lr=0.05, momentum=0.9), False),
    # Inductor runs the lone all_reduces in place in the matmuls' output buffers
    ("mlp", OptimSpec("adam", "fused"), True),
]


@pytest.mark.parametrize("model,optim,inductor", ALONE, ids=["hf_gpt2-sgd-fx", "mlp-adam-inductor"])
def test_parity_avg_with_gradients_reduced_alone(rank_pool, model, optim, inductor):
    case = ParityCase(model, optim, steps=4, reduce_op="avg", transformation=_alone(inductor))
    results = rank_pool.run(check_ddp_parity, case)
    if not inductor:
        assert all(r.max_param_diff == 0.0 for r in results), results


def test_parity_fails_without_collectives(rank_pool):
    case = ParityCase("mlp", OptimSpec("sgd", "foreach"), transformation=without_gradient_collectives)
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        rank_pool.run(check_ddp_parity, case)


def _group_and_mesh_job(rank: int, world_size: int) -> list[str]:
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import spmd_backend
    from spmd_backend.testing.models import MLP
    from spmd_backend.testing.models import MODELS as REGISTRY
    from spmd_backend.testing.parity import make_train_step

    names = []
    subgroup = dist.new_group(list(range(world_size)))
    mesh = init_device_mesh("cpu", (world_size,))
    for group in (subgroup, mesh):
        torch.manual_seed(0)
        model = MLP(32, 64, 3, 8)
        twin = copy.deepcopy(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
        step = spmd_backend.compile(
            parallel_mode=spmd_backend.DataParallel(reduce_op="avg", group=group)
        )(make_train_step(REGISTRY["mlp"]))
        gen = torch.Generator().manual_seed(rank)
        for _ in range(3):
            batch = torch.randn(8, 32, generator=gen)
            step(model, opt, batch)
            REGISTRY["mlp"].loss(twin, batch).backward()
            for p in twin.parameters():
                dist.all_reduce(p.grad, group=subgroup)
                p.grad /= world_size
            twin_opt.step()
            twin_opt.zero_grad()
        for p, q in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(p, q)
        expected = group.get_group().group_name if group is mesh else group.group_name
        names.append((expected, step.graph.expansion.group_name))
    return names


def test_process_group_and_device_mesh(rank_pool):
    per_rank = rank_pool.run(_group_and_mesh_job)
    for names in per_rank:
        for expected, used in names:
            assert used == expected
        assert names[0][1] != "0", "collectives must run on the given subgroup, not WORLD"
