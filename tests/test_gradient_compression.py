"""``DataParallel(gradient_compression="bf16"|"fp16")`` against DDP with the same hook, 2 gloo ranks.

DDP's ``bf16_compress_hook``/``fp16_compress_hook`` cast each bucket, divide it by the world
size, all_reduce it with sum and cast it back. The compiled step does the same per gradient
(expansion) and per bucket (bucketing): elementwise, so parameters and optimizer state must match
DDP's with the hook. Negative control: the same compiled step without compression must differ
from DDP with the hook (the low-precision rounding is visible), so the parity cannot pass
vacuously. Graph shape: casts around the collective, the collective in the low dtype.
"""

from __future__ import annotations

import pytest
import torch

from spmd_backend.errors import SpmdUsageError
from spmd_backend.gm_transformation import GraphModuleTransformation
from spmd_backend.parallel.data_parallel import DataParallel
from spmd_backend.testing.parity import OptimSpec, ParityCase, check_ddp_parity

pytestmark = pytest.mark.multirank

SGD = OptimSpec("sgd", "single", lr=0.05, momentum=0.9)


def _bucketed(gm):
    return GraphModuleTransformation(enable_graph_optimization=True, bucket_size_mb=0.01)(gm)


def _shard_bucketed(gm):
    """Bucketing with the reduce_scatters and all_gathers bucketed too (not gloo's default)."""
    import dataclasses

    from spmd_backend.passes import comm_fusion_with_concat, default_pipeline

    transformation = GraphModuleTransformation(enable_graph_optimization=True, bucket_size_mb=0.01)
    transformation.config = dataclasses.replace(transformation.config, passes=(
        (comm_fusion_with_concat, {"bucket_size_mb": 0.01, "shard_buckets": True}),
        *default_pipeline(0.01)[1:]))
    return transformation(gm)


CASES = {
    "bf16-avg-per-gradient": ParityCase("mlp", SGD, steps=4, reduce_op="avg",
                                        gradient_compression="bf16"),
    "fp16-avg-bucketed": ParityCase("mlp", SGD, steps=4, reduce_op="avg",
                                    gradient_compression="fp16", transformation=_bucketed),
    "bf16-sum-adam-bucketed": ParityCase("mlp", OptimSpec("adam", "foreach", lr=1e-3), steps=4,
                                         gradient_compression="bf16", transformation=_bucketed),
    "bf16-avg-hf-gpt2-bucketed": ParityCase("hf_gpt2", SGD, steps=3, reduce_op="avg",
                                            gradient_compression="bf16", transformation=_bucketed),
    # SGD: Adam turns a one-ulp fp16 rounding flip of a near-zero gradient (the traced and the
    # eager encoder round their fp32 gradients differently) into a full lr-sized step
    "fp16-avg-torch-encoder": ParityCase("torch_encoder", SGD, steps=3, reduce_op="avg",
                                         gradient_compression="fp16"),
    "bf16-dynamo": ParityCase("mlp", SGD, steps=4, reduce_op="avg", gradient_compression="bf16",
                              dynamo_options={"inductor": False}),
    # sharded optimizer state: each rank's reduce_scatter slice of the compressed sum (or, gloo's
    # default, its slice of the compressed all_reduce)
    "fp16-avg-sharded-sgd": ParityCase("mlp", SGD, steps=4, reduce_op="avg",
                                       gradient_compression="fp16", shard_optimizer=True,
                                       reduce_scatter_grads=True),
    "bf16-avg-sharded-torch-encoder": ParityCase("torch_encoder", SGD, steps=3, reduce_op="avg",
                                                 gradient_compression="bf16", shard_optimizer=True),
    "bf16-sum-sharded-adam-shard-buckets": ParityCase(
        "mlp", OptimSpec("adam", "foreach", lr=1e-3), steps=4, gradient_compression="bf16",
        shard_optimizer=True, transformation=_shard_bucketed, reduce_scatter_grads=True),
}


def _parity(rank: int, world: int, case: ParityCase) -> float:
    return check_ddp_parity(rank, world, case).max_param_diff


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_ddp_with_the_same_compression_hook(rank_pool, name):
    rank_pool.run(_parity, CASES[name])


def _uncompressed_against_hook(rank: int, world: int) -> str:
    import dataclasses

    case = dataclasses.replace(CASES["bf16-avg-per-gradient"])
    # the compiled side without compression, DDP with the bf16 hook
    from spmd_backend.testing import parity

    original = parity._compiled_step

    def uncompressed(c, step):
        return original(dataclasses.replace(c, gradient_compression=None), step)

    parity._compiled_step = uncompressed
    try:
        check_ddp_parity(rank, world, case)
    except AssertionError as e:
        return str(e)
    finally:
        parity._compiled_step = original
    return "matched"


def test_negative_control_uncompressed_step_differs_from_the_hook(rank_pool):
    for message in rank_pool.run(_uncompressed_against_hook):
        assert message != "matched", "the bf16 rounding must be visible to the parity check"


def _graph_job(rank: int, world: int, sharded: bool) -> dict:
    import spmd_backend
    from spmd_backend.graph import ops

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    c10d = torch.ops._c10d_functional
    kind = c10d.reduce_scatter_tensor.default if sharded else c10d.all_reduce.default

    @spmd_backend.compile(gm_transformation=_bucketed,
                          parallel_mode=DataParallel(reduce_op="avg", gradient_compression="bf16",
                                                     shard_optimizer=sharded,
                                                     reduce_scatter_grads=sharded or None))
    def step(model, opt, x):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()

    step(model, opt, torch.randn(4, 8))
    graph = getattr(step.graph.runner, "graph", step.graph.traced.gm.graph)
    comms = [n for n in graph.nodes if ops.is_call_to(n, kind)]
    gathers = [n for n in graph.nodes if ops.is_call_to(n, c10d.all_gather_into_tensor.default)]
    return {
        "dtypes": sorted({str(n.args[0].meta["val"].dtype) for n in comms}),
        "ops": sorted({str(n.args[1]) for n in comms}),
        "count": len(comms),
        "gathered": sorted({str(n.args[0].meta["val"].dtype) for n in gathers}),
    }


def test_collectives_run_in_the_compressed_dtype(rank_pool):
    out = rank_pool.run(_graph_job, False)[0]
    assert out["dtypes"] == ["torch.bfloat16"] and out["ops"] == ["sum"], out
    assert 1 <= out["count"] < 4, out  # bucketed: fewer collectives than the 4 gradients


def test_sharded_reduce_scatters_run_in_the_compressed_dtype(rank_pool):
    out = rank_pool.run(_graph_job, True)[0]
    assert out["dtypes"] == ["torch.bfloat16"] and out["ops"] == ["sum"], out
    # every parameter has >= 2 elements: 4 sharded, one reduce_scatter each (asked for: gloo's
    # default all-reduces and slices)
    assert out["count"] == 4 and out["gathered"] == ["torch.float32"], out


def test_options_are_validated():
    with pytest.raises(SpmdUsageError, match="gradient_compression='int8'"):
        DataParallel(gradient_compression="int8")
    assert DataParallel(gradient_compression="bf16", shard_optimizer=True).shard_optimizer


def _two_backward_job(rank: int, world: int, door: str, set_to_none: bool) -> float:
    """Two ``backward()`` calls per step, bf16 compression: DDP with ``no_sync`` and the hook
    compresses the accumulated fp32 total once. Until 2026-11-28 the Dynamo door compressed and
    reduced each backward's gradient on its own (3.3e-4 off after six SGD steps), also into
    gradients kept by ``zero_grad(set_to_none=False)``."""
    import copy

    import torch.distributed as dist

    import spmd_backend

    def step(model, opt, x, y):
        for k in range(2):
            torch.nn.functional.mse_loss(model(x[k::2]), y[k::2]).div(2).backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)

    def reference(model, opt, x, y):
        for k in range(2):
            torch.nn.functional.mse_loss(model(x[k::2]), y[k::2]).div(2).backward()
        for p in model.parameters():  # the hook: cast, divide, sum in bf16, cast back
            g = p.grad.to(torch.bfloat16).div_(world)
            dist.all_reduce(g)
            p.grad.copy_(g.float())
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(13, 33), torch.nn.Tanh(), torch.nn.Linear(33, 5))
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    if door == "dynamo":
        compiled = torch.compile(step, backend="spmd", options={
            "inductor": False, "reduce_op": "avg", "gradient_compression": "bf16"})
    else:
        compiled = spmd_backend.compile(parallel_mode=DataParallel(
            reduce_op="avg", gradient_compression="bf16"))(step)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(6):
        x, y = torch.randn(8, 13, generator=gen), torch.randn(8, 5, generator=gen)
        compiled(model, opt, x, y)
        reference(ref, ref_opt, x, y)
    return max(float((p - q).abs().max()) for p, q in zip(model.parameters(), ref.parameters()))


@pytest.mark.parametrize("door, set_to_none", [("compile", True), ("dynamo", True),
                                               ("dynamo", False)])
def test_two_backward_calls_compress_the_accumulated_gradient_once(rank_pool, door, set_to_none):
    """(The compile door still reduces each backward's part into kept gradients: documented.)"""
    for worst in rank_pool.run(_two_backward_job, door, set_to_none):
        assert worst < 1e-6, worst
