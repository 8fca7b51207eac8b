"""A float Dynamo made dynamic (a scheduler's lr, momentum, betas) stays a graph input through
``backend="spmd"`` (spmd_backend/dynamo/float_inputs.py and the scope's fused-lr patch).

Until 2026-11-28 a per-call schedule on SGD (single-tensor, foreach or fused), on foreach or fused
Adam/AdamW, RMSprop, Adadelta, foreach Adamax/NAdam/RAdam/ASGD, or OneCycleLR's moving momentum
or betas, compiled a new graph on every call and was refused at Dynamo's recompile limit. Here
each runs past that limit in two compiles (the first call bakes the initial value, the second
makes it dynamic) and matches eager.
"""

from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.nn as nn

from spmd_backend.dynamo.float_inputs import tensorify_float_inputs
from spmd_backend.testing.steps import train_step


def _dynamic_graph(fn, *calls):
    """Dynamo's graph of ``fn`` after its float argument changed (the dynamic recompile)."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=capture)
    for args in calls:
        compiled(*args)
    return graphs[-1]


def _uses(gm, node_name: str) -> list[str]:
    node = next(n for n in gm.graph.nodes if n.name == node_name)
    return sorted(str(u.target) for u in node.users)


def test_pass_rewrites_scalar_uses_and_keeps_the_results():
    def fn(x, s):
        y = x * 2
        y.mul_(s)
        z = y.add(x, alpha=s)
        w = torch._foreach_mul([x, y], s)
        return z, w[0] + w[1], (1 - s) / x, s ** (x[:1] * 0 + 3)

    x = torch.randn(64, generator=torch.Generator().manual_seed(0))
    gm = _dynamic_graph(fn, (x, 0.5), (x, 0.25))
    assert [n.target for n in gm.graph.nodes if n.op == "call_method"].count("item") == 1
    rewritten = tensorify_float_inputs(gm)
    # mul_, add(alpha=), _foreach_mul, the reversed division, the scalar-base pow
    assert rewritten == 5, gm.code
    # the SymFloat now feeds only its tensor twin and float arithmetic (1 - s, whose own twin
    # the division takes)
    assert _uses(gm, "item") == sorted([str(operator.mul), str(operator.sub)]), gm.code
    assert _uses(gm, "sub") == [str(operator.mul)], gm.code
    assert "reciprocal" in gm.code  # eager's ``s / x`` is ``x.reciprocal() * s``
    for s in (0.125, 0.3):
        got = gm(x, torch.tensor(s, dtype=torch.float64))
        want = fn(x.clone(), s)
        assert [g.dtype for g in got] == [w.dtype for w in want]
        # alpha=s: the product is rounded where eager's multiply-add is not (one float32 ulp)
        torch.testing.assert_close(got[0], want[0], rtol=2.4e-7, atol=0)
        for g, w in zip(got[1:], want[1:]):
            torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("use", ["clamp", "bfloat16", "tensor_pow"])
def test_a_float_with_a_use_it_cannot_keep_is_baked_whole(use):
    """One use the pass does not keep bakes the float for the whole frame: nothing is
    rewritten and Dynamo is asked to restart with the value baked. Keeping it in ``x * s`` and
    baking it in ``x.clamp(max=s)`` is what AOTAutograd's tensorify does on its own, without a
    restart; the AOTAutograd cache then served the first value's graph to later values (stock
    torch.compile too), and after cc620ef a bfloat16 Adam's moving beta1 was stale so."""

    from torch._dynamo.exc import TensorifyScalarRestartAnalysis
    from torch._dynamo.symbolic_convert import TensorifyState

    def fn(x, s):
        y = x * s
        if use == "clamp":
            return y, x.clamp(max=s)
        if use == "bfloat16":
            return y, x.bfloat16().mul_(s)
        return y, x.abs().pow(s)

    x = torch.randn(8)
    gm = _dynamic_graph(fn, (x, 0.5), (x, 0.25))
    before = gm.code
    TensorifyState.clear()
    try:
        with pytest.raises(TensorifyScalarRestartAnalysis):
            tensorify_float_inputs(gm)
        assert not TensorifyState.empty()
    finally:
        TensorifyState.clear()
    assert gm.code == before


def test_float_arithmetic_and_comparisons_keep_the_float(fake_pg):
    """``s ** 2``, ``max(s, c)``, ``math.sqrt(s)`` and ``torch.where(g > s, ...)`` in a user's
    update: tensorify replays the arithmetic and a comparison takes a 0-dim tensor, so the float
    stays an input (two compiles) and every call matches eager."""
    import math

    from torch._dynamo.utils import counters

    def step(model, x, s):
        loss = model(x).pow(2).mean()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                g = torch.where(p.grad.abs() > s * 0.01, p.grad, p.grad * 0.5)
                p.sub_(g * (s ** 2) * max(s, 0.05) / math.sqrt(s))
                p.grad = None
        return loss.detach()

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    twin = copy.deepcopy(model)
    compiled = torch.compile(step, backend="spmd", options={"inductor": False, "reduce_op": "sum"})
    with torch._dynamo.config.patch(recompile_limit=4):
        for i, s in enumerate([0.5, 0.25, 0.3, 0.2, 0.1, 0.4]):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
            compiled(model, x, s)
            step(twin, x, s)
    assert counters["spmd"]["whole_step_graphs"] == 2, dict(counters["spmd"])
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)


def test_a_float_baked_for_one_step_is_not_baked_for_another(fake_pg):
    """Dynamo keeps bake requests (``TensorifyState``) across frames and float symbol names
    repeat: a bfloat16 step whose lr is baked made a later float32 step bake its own float too,
    recompiling on every value. The requests are dropped once their frame has compiled."""
    from torch._dynamo.symbolic_convert import TensorifyState
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    low = nn.Linear(8, 2).bfloat16()
    full = nn.Linear(8, 2)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (low, full)]
    options = {"inductor": False, "reduce_op": "sum"}
    first = torch.compile(lambda m, o, x: train_step(m, o, x), backend="spmd", options=options)
    second = torch.compile(lambda m, o, x: train_step(m, o, x), backend="spmd", options=options)
    with torch._dynamo.config.patch(recompile_limit=10):
        for i in range(3):
            for o in opts:
                o.param_groups[0]["lr"] = 0.1 / (i + 1)
            first(low, opts[0], torch.randn(4, 8).bfloat16())  # baked: a graph per value
        assert TensorifyState.empty()
        before = counters["spmd"]["whole_step_graphs"]
        for i in range(5):
            opts[1].param_groups[0]["lr"] = 0.1 / (i + 1)
            second(full, opts[1], torch.randn(4, 8))
    assert counters["spmd"]["whole_step_graphs"] - before == 2, dict(counters["spmd"])


def _clamped_sgd_step(model, x, s):
    loss = model(x).pow(2).mean()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(p.grad * s)
            p.clamp_(max=s)
            p.grad = None
    return loss.detach()


def test_a_float_baked_in_one_use_is_current_in_every_call(fake_pg, monkeypatch, tmp_path):
    """A user's step that uses a per-call float as a tensor operand and as a clamp bound: every
    call uses its own value (through a fresh AOTAutograd cache, where the stale graph came
    from)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    twin = copy.deepcopy(model)
    compiled = torch.compile(_clamped_sgd_step, backend="spmd",
                             options={"inductor": False, "reduce_op": "sum"})
    with torch._dynamo.config.patch(recompile_limit=20):
        for i, s in enumerate([0.5, 0.25, 0.3, 0.2, 0.1]):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
            compiled(model, x, s)
            _clamped_sgd_step(twin, x, s)
            for p, q in zip(model.parameters(), twin.parameters()):
                torch.testing.assert_close(p, q, msg=f"call {i} (s={s})")


def test_pass_leaves_a_graph_without_dynamic_floats_alone():
    gm = _dynamic_graph(lambda x, s: x * s, (torch.randn(3), 0.5))  # one call: s is a constant
    before = gm.code
    assert tensorify_float_inputs(gm) == 0
    assert gm.code == before


def _optimizer(name: str, **kw):
    def build(model, *, schedule: str):
        opt = getattr(torch.optim, name)(model.parameters(), lr=0.01, **kw)
        if schedule == "cosine":
            return opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, 10)
        return opt, torch.optim.lr_scheduler.OneCycleLR(
            opt, 0.05, total_steps=20, cycle_momentum=schedule == "onecycle_momentum")
    return build


CASES = {
    # SGD's alpha=-lr (single and foreach), its fused kernel's float lr; single-tensor was bit
    # for bit on earlier sessions' hosts and is one ulp off (1.5e-8, one element) on an AMD EPYC
    # host with AVX2 kernels, at 460cd78 (the last session's HEAD) too
    "sgd-single-cosine": (_optimizer("SGD", momentum=0.9, foreach=False), "cosine", 1e-7),
    "sgd-foreach-onecycle": (_optimizer("SGD", momentum=0.9, foreach=True), "onecycle_momentum", 1e-7),
    "sgd-fused-cosine": (_optimizer("SGD", momentum=0.9, fused=True), "cosine", 0),
    # foreach Adam's _foreach_div_(bc, lr) and, with moving betas, _foreach_lerp_/_foreach_pow
    "adam-foreach-onecycle": (_optimizer("Adam", foreach=True), "onecycle_momentum", 1e-7),
    "adamw-fused-cosine": (_optimizer("AdamW", fused=True), "cosine", 0),
    # single-tensor Adam's lerp_(grad, 1 - beta1) and beta1 ** step
    "adam-single-onecycle": (_optimizer("Adam", foreach=False), "onecycle_momentum", 1e-7),
    # RMSprop's addcdiv_(value=-lr), which Dynamo writes as prims.fma
    "rmsprop-single-cosine": (_optimizer("RMSprop", foreach=False), "cosine", 1e-5),
}


def _scheduled_run(case: str, options: dict, calls: int) -> tuple[nn.Module, nn.Module]:
    """``calls`` steps of CASES[case] through ``backend="spmd"`` and eagerly, the schedule
    stepped after each; Dynamo's recompile limit at 4 (a graph per value: refused at the 5th).
    Returns the compiled model and its eager twin."""
    from torch._dynamo.utils import counters

    build, schedule, _ = CASES[case]
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    twin = copy.deepcopy(model)
    (opt, sched), (ref_opt, ref_sched) = build(model, schedule=schedule), build(twin, schedule=schedule)
    compiled = torch.compile(train_step, backend="spmd", options={"reduce_op": "sum", **options})
    with torch._dynamo.config.patch(recompile_limit=4):
        for i in range(calls):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
            compiled(model, opt, x)
            train_step(twin, ref_opt, x)
            sched.step()
            ref_sched.step()
    assert counters["spmd"]["whole_step_graphs"] == 2, dict(counters["spmd"])
    return model, twin


@pytest.mark.parametrize("case", list(CASES))
def test_a_per_call_schedule_compiles_twice_and_matches_eager(fake_pg, case):
    model, twin = _scheduled_run(case, {"inductor": False}, calls=7)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=CASES[case][2])


def test_a_bfloat16_adam_under_one_cycle_uses_each_calls_betas(fake_pg, monkeypatch, tmp_path):
    """bfloat16 single-tensor AdamW with OneCycleLR moving beta1 every call: its ``lerp_`` weight
    is not kept as a tensor in bfloat16 (the kernel rounds a Python weight differently), so
    beta1 is baked and each value recompiles. After cc620ef the lr was kept and beta1 baked in
    place, and every call from the third on used one stale beta1 (0.17 off eager after 12 calls)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)).bfloat16()
    twin = copy.deepcopy(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=0.01, foreach=False) for m in (model, twin)]
    scheds = [torch.optim.lr_scheduler.OneCycleLR(o, 0.05, total_steps=20) for o in opts]
    compiled = torch.compile(train_step, backend="spmd",
                             options={"inductor": False, "reduce_op": "sum"})
    with torch._dynamo.config.patch(recompile_limit=20):
        for i in range(6):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i)).bfloat16()
            compiled(model, opts[0], x)
            train_step(twin, opts[1], x)
            for s in scheds:
                s.step()
    for p, q in zip(model.parameters(), twin.parameters()):  # bf16 Adam: an ulp or two apart
        torch.testing.assert_close(p.float(), q.float(), rtol=0, atol=8e-3)


@pytest.mark.parametrize("case", ["sgd-single-cosine", "adam-single-onecycle"])
def test_inductor_compiles_a_per_call_schedule_in_this_process(fake_pg, caplog, case):
    """Compiled in this process (``background_compile=False``), the graph came with Dynamo's
    fake tensors, whose shape environment still held the lr's float symbol: compile_fx's
    tensorify pass asked for a Dynamo restart it could not get, and until 2026-11-28 every
    single-tensor optimizer under a scheduler ran as an fx graph, with only a warning
    (lowering/inductor.py ``_settled_float_symbols``)."""
    import logging

    # AOTAutograd's cache would skip the tensorify pass on a warm cache
    with caplog.at_level(logging.INFO, logger="spmd_backend"), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        model, twin = _scheduled_run(case, {"background_compile": False}, calls=6)
    assert "could not compile" not in caplog.text
    assert caplog.text.count("Inductor compiled") == 2, caplog.text
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5)
