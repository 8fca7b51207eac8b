"""Lowering: fused-optimizer decomposition (fast) and Inductor end to end (slow, CPU C++)."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import spmd_backend
from spmd_backend.gm_transformation import GraphModuleTransformation
from spmd_backend.graph import ops
from spmd_backend.lowering import InductorModule
from spmd_backend.lowering.fused_decomp import decompose_fused_optimizers
from spmd_backend.testing.models import MLP


def step_fn(model, optim, batch):
    loss = model(batch).pow(2).mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


OPTIMS = [
    (torch.optim.Adam, dict(lr=0.01, fused=True)),
    (torch.optim.AdamW, dict(lr=0.01, fused=True, weight_decay=0.1, amsgrad=True)),
    (torch.optim.Adam, dict(lr=0.01, fused=True, maximize=True, weight_decay=0.01)),
    (torch.optim.SGD, dict(lr=0.05, fused=True, momentum=0.9, nesterov=True, weight_decay=0.01)),
    (torch.optim.SGD, dict(lr=0.05, fused=True, momentum=0.9, dampening=0.1)),
]


def decomposed(gm):
    n = decompose_fused_optimizers(gm)
    assert n == 1
    assert not any("_fused_" in str(node.target) for node in gm.graph.nodes)
    return gm


@pytest.mark.parametrize("cls,kw", OPTIMS, ids=lambda x: getattr(x, "__name__", "") or str(x))
def test_fused_decomposition_matches_the_kernel(fake_pg, cls, kw):
    torch.manual_seed(0)
    model = MLP(8, 16, 3, 4)
    ref = copy.deepcopy(model)
    opt, ref_opt = cls(model.parameters(), **kw), cls(ref.parameters(), **kw)
    step = spmd_backend.compile(gm_transformation=decomposed)(step_fn)
    for _ in range(4):
        batch = torch.randn(4, 8)
        step(model, opt, batch)
        step_fn(ref, ref_opt, batch)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)
    for p, q in zip(model.parameters(), ref.parameters()):
        for k, v in opt.state[p].items():
            torch.testing.assert_close(v, ref_opt.state[q][k])


def _low_precision_step(model, optim, batch):
    loss = model(batch.to(torch.float16 if model[0].weight.dtype == torch.float16
                          else torch.bfloat16)).float().pow(2).mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("cls,kw", OPTIMS[:2], ids=["Adam", "AdamW"])
def test_fused_decomposition_of_low_precision_parameters_computes_in_float32(
        fake_pg, dtype, cls, kw):
    """The fused kernels read bfloat16/float16 tensors as float32 and round the results once;
    the decomposition computed in the parameter's dtype, where eps (1e-8) is 0 in float16: a
    float16 model under Adam(fused=True) became nan on its second step (eager trained), and
    bfloat16 drifted from eager (before 2026-11-27)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 4)).to(dtype)
    ref = copy.deepcopy(model)
    opt, ref_opt = cls(model.parameters(), **kw), cls(ref.parameters(), **kw)
    step = spmd_backend.compile(gm_transformation=decomposed)(_low_precision_step)
    for _ in range(2):
        batch = torch.randn(16, 8)
        step(model, opt, batch)
        _low_precision_step(ref, ref_opt, batch)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.dtype == dtype
        torch.testing.assert_close(p, q, atol=0, rtol=0)
        for k, v in opt.state[p].items():
            torch.testing.assert_close(v, ref_opt.state[q][k], atol=0, rtol=0)


def amp_step_fn(model, optim, batch, scaler):
    optim.zero_grad()  # first, so that the gradients the kernel writes back stay visible
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(batch).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(optim)
    scaler.update()
    return loss


@pytest.mark.parametrize("cls,kw", OPTIMS, ids=lambda x: getattr(x, "__name__", "") or str(x))
def test_fused_decomposition_with_a_grad_scaler_matches_the_kernel(fake_pg, cls, kw):
    """A GradScaler hands the fused kernel grad_scale and found_inf: the decomposition divides
    the gradients (and writes them back, as the kernel does) and changes nothing on a step with
    an inf gradient (steps 1 and 3 here; a skipped first step is the bootstrap graph's, which
    is not lowered)."""
    torch.manual_seed(0)
    model = MLP(8, 16, 3, 4)
    ref = copy.deepcopy(model)
    opt, ref_opt = cls(model.parameters(), **kw), cls(ref.parameters(), **kw)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    step = spmd_backend.compile(gm_transformation=decomposed)(amp_step_fn)
    for i in range(5):
        batch = torch.randn(4, 8)
        if i in (1, 3):
            batch[1, 2] = float("inf")
        step(model, opt, batch, scaler)
        amp_step_fn(ref, ref_opt, batch, ref_scaler)
        assert scaler.get_scale() == ref_scaler.get_scale()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q)
            torch.testing.assert_close(p.grad, q.grad, equal_nan=True)
    assert ref_scaler.get_scale() != 2.0**10  # the skipped steps backed the scale off
    for p, q in zip(model.parameters(), ref.parameters()):
        for k, v in opt.state[p].items():
            torch.testing.assert_close(v, ref_opt.state[q][k])


def _materialized(graph):
    return [n for n in graph.nodes if n.target is torch.ops.spmd_backend.materialize.default]


def _scalar(n):
    val = n.meta.get("val")
    if isinstance(val, (list, tuple)):
        return bool(val) and all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in val)
    return isinstance(val, torch.Tensor) and val.dim() == 0


@pytest.mark.parametrize("foreach", [False, True], ids=["single", "foreach"])
def test_bias_corrections_are_materialized_before_the_parameter_loops(fake_pg, foreach):
    """Inductor's C++ backend evaluates an inlined 0-dim chain once per vector: in the functional
    step graph, every pow-derived scalar that parameter math reads comes through one
    ``spmd_backend::materialize``, and running the graph gives what it gave before."""
    from spmd_backend.graph.ops import SCALAR_POW_TARGETS
    from spmd_backend.lowering.scalar_chains import materialize_scalar_chains

    torch.manual_seed(0)
    model = MLP(8, 16, 3, 4)
    twin = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, foreach=foreach)
    twin_opt = torch.optim.Adam(twin.parameters(), lr=0.01, foreach=foreach)
    seen = {}

    def rewrite(gm):
        seen["copied"] = materialize_scalar_chains(gm.graph)
        gm.recompile()
        derived = set()
        for n in gm.graph.nodes:
            if n.op != "call_function" or n.target is torch.ops.spmd_backend.materialize.default:
                continue
            if _scalar(n) and (n.target in SCALAR_POW_TARGETS
                               or any(a in derived for a in n.all_input_nodes)):
                derived.add(n)
            elif not _scalar(n) and n.meta.get("val") is not None:
                assert not derived & set(n.all_input_nodes), n.format_node()
        seen["copies"] = len(_materialized(gm.graph))
        return gm

    step = spmd_backend.compile(gm_transformation=rewrite)(step_fn)
    plain = spmd_backend.compile()(step_fn)
    for _ in range(3):
        batch = torch.randn(4, 8)
        step(model, opt, batch)
        plain(twin, twin_opt, batch)
    n_params = len(list(model.parameters()))
    assert seen["copied"] >= n_params
    # one copy per parameter's update (single-tensor loop), one per group (foreach)
    assert seen["copies"] == (1 if foreach else n_params)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


@pytest.mark.slow
@pytest.mark.parametrize("foreach", [False, True], ids=["single", "foreach"])
def test_adam_loops_through_inductor_match_eager(fake_pg, foreach):
    torch.manual_seed(0)
    model = MLP(8, 16, 3, 4)
    ref = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, foreach=foreach)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01, foreach=foreach)
    step = spmd_backend.compile(gm_transformation=GraphModuleTransformation(
        enable_graph_optimization=True, enable_inductor=True))(step_fn)
    codes = []
    for i in range(4):
        batch = torch.randn(4, 8)
        if i < 2:  # the bootstrap and the steady-state compiles
            codes += run_and_get_code(step, model, opt, batch)[1]
        else:
            step(model, opt, batch)
        step_fn(ref, ref_opt, batch)
    assert isinstance(step.compiled._gm("main"), InductorModule)
    # Inductor ran the post-grad pass: the bias corrections are computed before the loops
    assert any("spmd_backend.materialize" in c for c in codes)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], ref_opt.state[q]["exp_avg_sq"])


@pytest.mark.slow
def test_transformation_with_passes_and_inductor(fake_pg):
    torch.manual_seed(0)
    model = MLP(16, 32, 3, 8)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, fused=True, weight_decay=0.1)
    transformation = GraphModuleTransformation(
        enable_graph_optimization=True, enable_inductor=True, dump_graphs=True
    )
    step = spmd_backend.compile(gm_transformation=transformation)(step_fn)
    plain = spmd_backend.compile()(step_fn)
    for i in range(5):
        batch = torch.randn(8, 16)
        step(model, opt, batch, **({"last_train_step": True} if i == 4 else {}))
        plain(ref, ref_opt, batch)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)
    igm = step.compiled
    assert all(isinstance(igm._gm(k), InductorModule) for k in ("setup", "main", "cleanup"))
    assert [r.name for r in transformation.pass_records] == [
        "comm_fusion_with_concat", "schedule_comm_wait", "remove_copy_from_optimizer",
        "commit_writes_late",
    ]
    files = set(os.listdir(transformation.dump_folder))
    assert "traced.graph" in files and "final.main.graph" in files
    assert "00.comm_fusion_with_concat.before.main.graph" in files
    assert "02.remove_copy_from_optimizer.after.main.graph" in files
    assert "03.commit_writes_late.after.main.graph" in files
    # the compiled graph still holds the bucketed collective (Inductor keeps it in order)
    assert any(ops.is_all_reduce(n) for n in igm._gm("main").graph.nodes)


def test_amp_step_with_a_fused_optimizer_is_lowered(fake_pg):
    """A GradScaler with a fused optimizer: the step graph compiles with Inductor (before
    2026-11-26 the kernel's in-place AMP form made Inductor's re-trace fail, and every such
    step ran as the fx graph) and skips the step with the inf gradient like eager."""
    torch.manual_seed(0)
    model = MLP(16, 32, 3, 8)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, fused=True, weight_decay=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    step = spmd_backend.compile(gm_transformation=GraphModuleTransformation(
        enable_graph_optimization=True, enable_inductor=True, background_compile=False))(amp_step_fn)
    for i in range(5):
        batch = torch.randn(8, 16)
        if i == 3:
            batch[0, 0] = float("inf")
        step(model, opt, batch, scaler)
        amp_step_fn(ref, ref_opt, batch, ref_scaler)
    assert isinstance(step.compiled._gm("main"), InductorModule)
    assert scaler.get_scale() == ref_scaler.get_scale()
    assert {int(s["step"]) for s in opt.state.values()} == {4}
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-4)


def test_flat_output_copy_shares_constants_instead_of_copying_them():
    """A Dynamo graph may hold a fake tensor constant; deep-copying the module to flatten its
    outputs raised "set the storage of a tensor on device meta" (hf GPT-2 through the Dynamo
    door with Inductor). The copy shares attributes and leaves the original graph alone."""
    import torch.fx as fx
    from torch._subclasses.fake_tensor import FakeTensorMode

    from spmd_backend.lowering.inductor import _flat_output_copy

    root = torch.nn.Module()
    with FakeTensorMode():
        root.const = torch.ones(3)
    graph = fx.Graph()
    x = graph.placeholder("x")
    c = graph.get_attr("const")
    y = graph.call_function(torch.ops.aten.add.Tensor, (x, c))
    graph.output({"y": y})
    gm = fx.GraphModule(root, graph)
    flat, spec = _flat_output_copy(gm)
    assert flat.const is gm.const
    assert flat.graph is not gm.graph
    assert isinstance(list(gm.graph.nodes)[-1].args[0], dict)  # the original keeps its outputs
    assert torch.utils._pytree.tree_unflatten(["out"], spec) == {"y": "out"}


def test_a_user_post_grad_pass_still_runs_and_compiles_in_this_process(fake_pg):
    """A ``post_grad_custom_pre_pass`` the user set runs with ours (not replaced by it), and the
    background lowering compiles in this process, since a worker would not receive it."""
    import uuid

    from torch._inductor.custom_graph_pass import CustomGraphPass

    from spmd_backend.lowering.background import BackgroundLowered, lower_in_background

    class Recorder(CustomGraphPass):
        def __init__(self) -> None:
            self.calls = 0
            self.key = uuid.uuid4().bytes  # never an FX-graph cache hit, which would skip passes

        def __call__(self, graph) -> None:
            self.calls += 1

        def uuid(self) -> bytes:
            return self.key

    recorder, lowered = Recorder(), []

    def transform(gm):
        lowered.append(lower_in_background(gm))
        return lowered[-1]

    torch.manual_seed(0)
    model = MLP(8, 16, 2, 4)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, foreach=True)
    codes = []
    with torch._inductor.config.patch(post_grad_custom_pre_pass=recorder):
        step = spmd_backend.compile(gm_transformation=transform)(step_fn)
        for _ in range(2):
            codes += run_and_get_code(step, model, opt, torch.randn(4, 8))[1]
        assert torch._inductor.config.post_grad_custom_pre_pass is recorder  # left as it was
    assert recorder.calls >= 1
    assert lowered and not any(isinstance(m, BackgroundLowered) for m in lowered)
    assert any("spmd_backend.materialize" in c for c in codes)  # ours ran too


def test_step_graphs_round_low_precision_as_eager_unless_the_user_chose(monkeypatch):
    import torch._inductor.config as inductor_config

    from spmd_backend.lowering.inductor import EMULATE_CASTS_ENV, step_graph_config

    monkeypatch.delenv(EMULATE_CASTS_ENV, raising=False)
    with step_graph_config():
        assert inductor_config.emulate_precision_casts is True
    monkeypatch.setenv(EMULATE_CASTS_ENV, "0")  # the user's choice: torch's setting stays
    with inductor_config.patch(emulate_precision_casts=False), step_graph_config():
        assert inductor_config.emulate_precision_casts is False


def test_muon_through_inductor_matches_eager():
    """torch.optim.Muon orthogonalizes in bf16; Inductor's fused kernels keep the bf16
    intermediates in fp32 (its default), 1.7e-3 off eager after four steps; step graphs are
    compiled with the casts emulated, as eager rounds (1.5e-8)."""
    from spmd_backend.testing import fake_process_group

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.Tanh(),
                                torch.nn.Linear(16, 4, bias=False))
    twin = copy.deepcopy(model)
    opt, ref = torch.optim.Muon(model.parameters(), lr=0.02), torch.optim.Muon(twin.parameters(), lr=0.02)
    with fake_process_group(world_size=1):
        step = spmd_backend.compile(gm_transformation=GraphModuleTransformation(
            enable_graph_optimization=True, enable_inductor=True, background_compile=False))(step_fn)
        for _ in range(4):
            batch = torch.randn(6, 8)
            step(model, opt, batch)
            step_fn(twin, ref, batch)
    assert isinstance(step.compiled._gm("main"), InductorModule)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
