"""remove_copy_from_optimizer on tiny graphs under a fake process group."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same_training, graph_code, run_pair
from torch.testing import FileCheck

from spmd_backend.graph import ops
from spmd_backend.pass_manager import PassManager
from spmd_backend.passes import remove_copy_from_optimizer

aten = torch.ops.aten


def reinplace(gm):
    PassManager([remove_copy_from_optimizer]).run(gm)
    return gm


def copies_into_placeholders(gm):
    return [n for n in gm.graph.nodes if ops.is_copy_(n) and n.args[0].op == "placeholder"]


@pytest.mark.parametrize(
    "optim_kind", ["adam_fused", "adamw_fused", "adam_foreach", "adam_single", "sgd_momentum", "sgd_foreach", "sgd_fused"]
)
def test_state_written_in_place_with_same_results(fake_pg, optim_kind):
    compiled, model, ref = run_pair(reinplace, optim_kind=optim_kind)
    assert_same_training(model, ref)
    after = copies_into_placeholders(compiled.compiled)
    # every parameter and optimizer-state write-back is now an in-place op, not a copy
    assert after == [], [n.format_node() for n in after]


def test_fused_kernel_becomes_in_place(fake_pg):
    compiled, model, ref = run_pair(reinplace, optim_kind="adam_fused")
    assert_same_training(model, ref)
    code = graph_code(compiled.compiled)
    FileCheck().check("aten._foreach_add_.Scalar").check("aten._fused_adam_.tensor_lr").check_not(
        "aten._fused_adam.tensor_lr"
    ).check_not("aten.copy_").run(code)


def test_does_not_touch_forward_mutations(fake_pg):
    from spmd_backend.testing.models import BatchNormNet

    def factory():
        return BatchNormNet(16, 32, 4)

    compiled, model, ref = run_pair(reinplace, optim_kind="sgd_momentum", model_factory=factory)
    assert_same_training(model, ref)
    torch.testing.assert_close(model.bn.running_mean, ref.bn.running_mean)
    # the BatchNorm statistics are not the optimizer's: they stay graph outputs, committed
    # after the graph succeeded, and the pass leaves them alone
    assert ("buffers", 0) in compiled.graph.layout.mutated_outputs
    assert not [n for n in copies_into_placeholders(compiled.compiled) if "bn" in n.args[0].name]


def test_view_ops_have_no_in_place_variant():
    """``detach_`` rewrites its input's metadata: on a bucket's view it raises, so a view op is
    never re-inplaced (found when a Dynamo-door gradient became a bucket view)."""
    from spmd_backend.passes.remove_copy import inplace_variant

    assert inplace_variant(aten.detach.default) is None
    assert inplace_variant(aten.t.default) is None
    assert inplace_variant(aten.add.Tensor) is aten.add_.Tensor
    assert inplace_variant(aten.mul.Tensor) is aten.mul_.Tensor


@pytest.mark.parametrize("optim_kw", [{"fused": True}, {"foreach": False}])
def test_update_feeding_a_collective_stays_functional(optim_kw):
    # sharded optimizer state: the update produces the shards the all_gathers send, so in place
    # it would write the state before their waits (and the runtime would snapshot all of it
    # every call); it stays functional and its write-backs go below the last collective
    import spmd_backend
    from spmd_backend.graph.commit import inputs_at_risk
    from spmd_backend.passes import commit_writes_late
    from spmd_backend.testing import fake_process_group
    from spmd_backend.testing.models import MLP
    from spmd_backend.testing.steps import train_step

    seen = {}

    def passes(gm):
        PassManager([remove_copy_from_optimizer, commit_writes_late]).run(gm)
        seen["graph"] = gm.graph
        return gm

    torch.manual_seed(0)
    model = MLP(8, 16, 2, 4)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, **optim_kw)
    with fake_process_group(world_size=2):
        step = spmd_backend.compile(
            gm_transformation=passes,
            parallel_mode=spmd_backend.DataParallel(reduce_op="avg", shard_optimizer=True),
        )(train_step)
        for _ in range(2):
            step(model, opt, torch.randn(4, 8))
    graph = seen["graph"]
    assert not [n for n in graph.nodes if n.target is aten._fused_adam_.tensor_lr]
    risk = inputs_at_risk(graph)  # nothing the step writes is written before a collective
    assert risk.positions == (), risk.names
    last_wait = max(i for i, n in enumerate(graph.nodes) if ops.is_wait(n))
    write_backs = [i for i, n in enumerate(graph.nodes)
                   if ops.is_copy_(n) and n.args[0].op == "placeholder"]
    assert write_backs and min(write_backs) > last_wait


@pytest.mark.parametrize("foreach", [False, True])
def test_no_in_place_write_to_a_shard_an_all_gather_still_sends(foreach):
    # ASGD's averaging reads the updated parameter shard after its all_gather is issued
    # (ax += (p - ax) * mu): made in place, ``sub`` wrote into the shard while gloo was still
    # sending it, and the Dynamo door's fx graph trained wrong (2 ranks, 0.35 after two steps)
    import spmd_backend
    from spmd_backend.graph.aliasing import alias_root, waits_of
    from spmd_backend.passes import comm_fusion_with_concat, commit_writes_late, schedule_comm_wait
    from spmd_backend.testing import fake_process_group
    from spmd_backend.testing.models import MLP
    from spmd_backend.testing.steps import train_step

    seen = {}

    def passes(gm):
        # gloo's all_gathers stay per parameter (shard_buckets False): each sends its shard itself
        PassManager([(comm_fusion_with_concat, {"shard_buckets": False}), schedule_comm_wait,
                     remove_copy_from_optimizer, commit_writes_late]).run(gm)
        seen["graph"] = gm.graph
        return gm

    torch.manual_seed(0)
    model = MLP(8, 16, 2, 4)
    opt = torch.optim.ASGD(model.parameters(), lr=0.01, t0=1.0, foreach=foreach)
    with fake_process_group(world_size=2):
        step = spmd_backend.compile(
            gm_transformation=passes,
            parallel_mode=spmd_backend.DataParallel(reduce_op="avg", shard_optimizer=True),
        )(train_step)
        for _ in range(2):  # the first call creates the state, untransformed
            step(model, opt, torch.randn(4, 8))
    nodes = list(seen["graph"].nodes)
    gathers = [n for n in nodes if n.target is torch.ops._c10d_functional.all_gather_into_tensor.default]
    assert gathers
    inplace = 0
    for g in gathers:
        start, end = nodes.index(g), nodes.index(waits_of(g)[0])
        sent = alias_root(g.args[0])
        between = nodes[start + 1:end]
        assert not [n for n in between if n.target is aten.copy_.default and alias_root(n.args[0]) is sent]
        for n in between:
            schema = getattr(n.target, "_schema", None)
            if schema is not None and schema.arguments and schema.arguments[0].alias_info is not None \
                    and schema.arguments[0].alias_info.is_write:
                inplace += 1
                first = n.args[0] if isinstance(n.args[0], torch.fx.Node) else None
                assert first is None or alias_root(first) is not sent, n.format_node()
    assert inplace  # the rest of the update is still in place between issue and wait


def test_write_back_returned_by_the_graph_becomes_its_destination():
    """AOTAutograd returns a mutated input (``.grad`` accumulated across calls through the
    Dynamo door) as the ``copy_`` that wrote it; the pass erased that copy while the output
    still used it and crashed. Re-inplaced, the output is the destination itself."""
    import torch.fx as fx

    from spmd_backend.graph.meta import Phase, annotate

    graph = fx.Graph()
    old, new = graph.placeholder("grad"), graph.placeholder("contribution")
    total = graph.call_function(aten.add.Tensor, (old, new))
    written = graph.call_function(aten.copy_.default, (old, total))
    graph.output((written,))
    for node in (old, new, total, written):
        node.meta["val"] = torch.empty(3)
    for node in (total, written):
        annotate(node, fqn=None, phase=Phase.OPTIMIZER)
    gm = reinplace(fx.GraphModule(torch.nn.Module(), graph))
    FileCheck().check("aten.add_.Tensor").check_not("aten.copy_").run(gm.code)
    g, c = torch.ones(3), torch.full((3,), 2.0)
    (out,) = gm(g, c)
    assert out is g and torch.equal(g, torch.full((3,), 3.0))


def _optimizer_graph(build):
    """A graph whose ops are all optimizer-phase, from ``build(graph, x)`` with one 4x4
    placeholder ``x`` (a matrix the optimizer computes with: not a graph input written back)."""
    import torch.fx as fx

    from spmd_backend.graph.meta import Phase, annotate

    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(4, 4)
    start = graph.call_function(aten.mul.Tensor, (x, 2.0))
    out = build(graph, start)
    graph.output((out,))
    for node in graph.nodes:
        if node.op == "call_function":
            node.meta["val"] = torch.empty(4, 4)
            annotate(node, fqn=None, phase=Phase.OPTIMIZER)
    return fx.GraphModule(torch.nn.Module(), graph)


@pytest.mark.parametrize("form", ["addmm_self_as_matrix", "add_transposed_self"])
def test_op_reading_what_it_would_overwrite_stays_functional(form):
    """torch.optim.Muon's Newton-Schulz step ``addmm(g, g, g)``: made ``addmm_``, the kernel
    overwrote ``g`` while its matrix product still read it, and Muon trained to NaN after one
    step in both doors. An element-wise op reading another view of what it writes
    (``add(x, x.t())``) is unsafe too."""
    def build(graph, g):
        if form == "addmm_self_as_matrix":
            return graph.call_function(aten.addmm.default, (g, g, g), {"beta": -4.7, "alpha": 2.0})
        t = graph.call_function(aten.t.default, (g,))
        return graph.call_function(aten.add.Tensor, (g, t))

    gm = _optimizer_graph(build)
    x = torch.randn(4, 4)
    expected = gm(x)[0]
    reinplace(gm)
    assert not [n for n in gm.graph.nodes if n.target in (aten.addmm_.default, aten.add_.Tensor)]
    torch.testing.assert_close(gm(x)[0], expected)


def test_element_wise_op_reading_the_same_tensor_is_made_in_place():
    def build(graph, g):
        return graph.call_function(aten.mul.Tensor, (g, g))

    gm = _optimizer_graph(build)
    x = torch.randn(4, 4)
    expected = gm(x)[0]
    reinplace(gm)
    assert [n for n in gm.graph.nodes if n.target is aten.mul_.Tensor]
    torch.testing.assert_close(gm(x)[0], expected)
