"""comm_fusion_with_concat on tiny graphs under a fake process group."""

from __future__ import annotations

import torch
from helpers import Net, assert_same_training, graph_code, run_pair
from torch.testing import FileCheck

from spmd_backend.graph import ops
from spmd_backend.graph.meta import Phase, bucket_params, get_phase
from spmd_backend.iter_graph_module import IterGraphModule
from spmd_backend.pass_manager import PassManager
from spmd_backend.passes import comm_fusion_with_concat, plan_buckets


def fuse(bucket_mb):
    def transformation(gm):
        PassManager([(comm_fusion_with_concat, {"bucket_size_mb": bucket_mb})]).run(gm)
        return gm

    return transformation


def test_one_bucket_per_cap_with_fx_names_and_numerics(fake_pg):
    # 4 KiB-ish gradients: everything after the first >= 1 MiB rule fits one bucket
    compiled, model, ref = run_pair(fuse(25))
    assert_same_training(model, ref)
    gm = compiled.compiled
    reduces = [n for n in gm.graph.nodes if ops.is_all_reduce(n)]
    assert [n.name for n in reduces] == ["all_reduce_default"]
    FileCheck().check_count("aten.view.default(", 6, exactly=False).check("aten.cat.default").check(
        "_c10d_functional.all_reduce.default(cat_default").check("wait_tensor").check(
        "split_with_sizes"
    ).run(graph_code(gm))
    assert set(bucket_params(reduces[0])) == {n for n, _ in model.named_parameters()}
    for n in gm.graph.nodes:
        if ops.is_all_reduce(n) or ops.is_wait(n) or n.target is torch.ops.aten.cat.default:
            assert get_phase(n) is Phase.COMM


def test_bucket_caps_follow_real_sizes(fake_pg):
    big = lambda: Net(dims=(16, 512, 512, 8))  # noqa: E731 - 1 MiB hidden weight
    compiled, model, ref = run_pair(fuse(0.5), model_factory=big)
    assert_same_training(model, ref)
    names = [n.name for n in compiled.compiled.graph.nodes if ops.is_all_reduce(n)]
    # readiness order: out.bias+out.weight (16 KiB), then the 1 MiB weight closes bucket 1,
    # then every later gradient reaches the 0.5 MiB cap or ends the plan
    assert names[:2] == ["all_reduce_default", "all_reduce_default_1"]
    plan_sizes = []
    for n in compiled.compiled.graph.nodes:
        if ops.is_all_reduce(n):
            plan_sizes.append(n.args[0].meta["val"].numel() * 4)
    assert plan_sizes[0] >= 1024 * 1024


def test_large_cpu_gradients_stay_alone_and_are_reduced_where_they_are_made(fake_pg):
    big = lambda: Net(dims=(16, 512, 512, 8))  # noqa: E731 - 1 MiB hidden weight

    def transformation(gm):
        PassManager([(comm_fusion_with_concat, {"bucket_size_mb": 25, "standalone_mb": 1.0})]).run(gm)
        return gm

    compiled, model, ref = run_pair(transformation, model_factory=big)
    assert_same_training(model, ref)
    reduces = [n for n in compiled.compiled.graph.nodes if ops.is_all_reduce(n)]
    alone = [n for n in reduces if bucket_params(n) == ["layers.1.weight"]]
    assert len(alone) == 1, [bucket_params(n) for n in reduces]
    # no packing: the collective reads the gradient itself, no view/cat copy in between
    grad = alone[0].args[0]
    assert grad.target is not torch.ops.aten.cat.default
    assert get_phase(grad) is not Phase.COMM, grad.format_node()
    # the rest is bucketed as before (one bucket under a 25 MiB cap)
    rest = [n for n in reduces if n is not alone[0]]
    assert len(rest) == 1 and len(bucket_params(rest[0])) == 5
    # planning agrees: with the threshold nothing is left to fuse; without it, the lone
    # gradient is an unfused collective again
    graph = compiled.compiled.graph
    assert plan_buckets(graph, 25, standalone_mb=1.0) == []
    (again,) = plan_buckets(graph, 25)
    assert [b.comm_node for b in again.blocks] == alone


def test_standalone_threshold_is_inclusive_and_off_by_default(fake_pg):
    big = lambda: Net(dims=(16, 512, 512, 8))  # noqa: E731

    def transformation(standalone):
        def run(gm):
            PassManager([(comm_fusion_with_concat, {"bucket_size_mb": 25,
                                                    "standalone_mb": standalone})]).run(gm)
            return gm
        return run

    counts = {}
    for standalone in (None, 1.0, 1.01, 0.01):
        compiled, model, ref = run_pair(transformation(standalone), model_factory=big, steps=2)
        counts[standalone] = len([n for n in compiled.compiled.graph.nodes if ops.is_all_reduce(n)])
    # off: the 1 MiB weight closes the first bucket with the last layer's gradients
    assert counts[None] == 2
    assert counts[1.0] == 2 and counts[1.01] == counts[None]
    # every weight (16 KiB and more) stays alone, the three biases share a bucket
    assert counts[0.01] == 4


def test_never_mixes_dtypes(fake_pg):
    mixed = lambda: Net(dims=(16, 32, 8))  # noqa: E731
    def factory():
        m = mixed()
        m.layers[1].to(torch.float64)
        return m

    compiled, model, ref = run_pair(fuse(25), model_factory=factory)
    assert_same_training(model, ref)
    dtypes = [n.args[0].meta["val"].dtype for n in compiled.compiled.graph.nodes if ops.is_all_reduce(n)]
    assert sorted(map(str, dtypes)) == ["torch.float32", "torch.float64"]


def test_absent_pattern_is_a_noop(fake_pg):
    def twice(gm):
        PassManager([(comm_fusion_with_concat, {"bucket_size_mb": 25})]).run(gm)
        before = len(gm.graph.nodes)
        assert plan_buckets(gm.graph, 25) == []
        PassManager([(comm_fusion_with_concat, {"bucket_size_mb": 25})]).run(gm)
        assert len(gm.graph.nodes) == before
        return gm

    compiled, model, ref = run_pair(twice)
    assert_same_training(model, ref)


def test_works_on_an_iter_graph_module(fake_pg):
    def on_igm(gm):
        igm = IterGraphModule(gm)
        PassManager([(comm_fusion_with_concat, {"bucket_size_mb": 25})]).run(igm)
        return igm

    compiled, model, ref = run_pair(on_igm)
    assert_same_training(model, ref)
