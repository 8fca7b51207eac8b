"""Every torch.optim optimizer, in every implementation, compiles and matches eager.

One process, fake process group. Each case runs a few steps of a tiny MLP while every lifted
hyper-parameter changes between steps (what a scheduler does): the step must not retrace and
must match an eager twin. The liftable-hyper-parameter table itself
(``spmd_backend.tracing.hyperparams.LIFTABLE``) was measured with ``tools/hyper_survey.py``.
"""

from __future__ import annotations

import copy
import inspect
import logging
import warnings

import pytest
import torch
import torch.nn as nn

import spmd_backend
from spmd_backend.testing.models import OneLowPrecisionLayer
from spmd_backend.tracing.hyperparams import install, lifted_slots, slot_value

CASES = [
    ("SGD", dict(lr=0.05)),
    ("SGD", dict(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.1)),
    ("SGD", dict(lr=0.05, momentum=0.9, nesterov=True, maximize=True)),
    ("Adam", dict(lr=0.01, amsgrad=True, weight_decay=0.1)),
    ("Adam", dict(lr=0.01, maximize=True, decoupled_weight_decay=True, weight_decay=0.1)),
    ("AdamW", dict(lr=0.01, maximize=True, amsgrad=True)),
    ("Adamax", dict(lr=0.01, weight_decay=0.1)),
    ("NAdam", dict(lr=0.01, weight_decay=0.1)),
    ("NAdam", dict(lr=0.01, weight_decay=0.1, decoupled_weight_decay=True)),
    ("RAdam", dict(lr=0.01, weight_decay=0.1)),
    ("RAdam", dict(lr=0.01, weight_decay=0.1, decoupled_weight_decay=True)),
    ("RMSprop", dict(lr=0.01, weight_decay=0.1, momentum=0.9)),
    ("RMSprop", dict(lr=0.01, centered=True)),
    ("Adagrad", dict(lr=0.05, lr_decay=0.01, weight_decay=0.1)),
    ("Adadelta", dict(lr=0.5, weight_decay=0.1)),
    ("ASGD", dict(lr=0.01, weight_decay=0.1, t0=2.0)),
    ("Rprop", dict(lr=0.01)),
]


def _impls(cls: type) -> list[tuple[str, dict]]:
    out = [("default", {}), ("foreach", dict(foreach=True)), ("single", dict(foreach=False))]
    if "fused" in inspect.signature(cls.__init__).parameters:
        out.append(("fused", dict(fused=True)))
    return out


PARAMS = [
    pytest.param(name, kw, ikw, id=f"{name}-{'-'.join(map(str, kw))}-{impl}")
    for name, kw in CASES
    for impl, ikw in _impls(getattr(torch.optim, name))
]


def step(model, optim, x):
    optim.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    optim.step()
    return loss


def schedule(opt: torch.optim.Optimizer) -> None:
    """Move every lifted hyper-parameter a little, as a scheduler would."""
    for slot in lifted_slots(opt):
        _, key, i = slot
        value = slot_value(opt, slot)
        if key == "betas":
            value -= 0.02 if i == 0 else 0.001
        elif key == "step_sizes":
            value = value * 1.1 if i == 0 else value - 1
        else:
            value *= 0.97
        install(opt.param_groups[slot[0]], slot, value)


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    names = {id(p): n for n, p in model.named_parameters()}
    out = {f"param {n}": p.detach() for n, p in model.named_parameters()}
    # the gradients the step leaves: an optimizer must not write into them (until 2026-11-28
    # single-tensor SGD's weight decay was added to .grad, as torch's differentiable path does)
    out.update({f"grad {n}": p.grad for n, p in model.named_parameters() if p.grad is not None})
    for p, st in opt.state.items():
        out.update({f"state {names[id(p)]}.{k}": v for k, v in st.items()})
    return out


@pytest.mark.parametrize("name,kw,ikw", PARAMS)
def test_optimizer_matches_eager_under_a_schedule(fake_pg, caplog, name, kw, ikw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    twin = copy.deepcopy(model)
    cls = getattr(torch.optim, name)
    opt, ref = cls(model.parameters(), **kw, **ikw), cls(twin.parameters(), **kw, **ikw)
    compiled = spmd_backend.compile()(step)
    for p in [*model.parameters(), *twin.parameters()]:  # each call sees gradients: no retrace
        p.grad = torch.zeros_like(p)
    with caplog.at_level(logging.WARNING, logger="spmd_backend"):
        for i in range(5):
            if i >= 2:  # step 1 bootstraps the state, step 2 traces the steady graph
                schedule(opt)
                schedule(ref)
            x = torch.randn(6, 8)
            compiled(model, opt, x)
            step(twin, ref, x)
    assert not [r for r in caplog.records if "retracing" in r.getMessage()]
    # RMSprop(centered) foreach: torch's capturable tensor-lr path rounds twice where eager's
    # alpha=-lr rounds once; the centered denominator amplifies that ulp
    tol = dict(rtol=1e-4, atol=1e-5) if name == "RMSprop" and ikw.get("foreach") else {}
    expected, actual = _state(twin, ref), _state(model, opt)
    assert expected.keys() == actual.keys()
    for k in expected:
        torch.testing.assert_close(actual[k], expected[k], msg=k, **tol)


@pytest.mark.parametrize("name,kw", [("SGD", dict(lr=0.05, momentum=0.9)),
                                     ("Adam", dict(lr=0.01)),
                                     ("RMSprop", dict(lr=0.01, momentum=0.9))])
def test_unfreezing_a_layer_after_some_steps_matches_eager(fake_pg, name, kw):
    """Fine-tuning that trains the head first and then unfreezes the body: the unfrozen weight
    starts its optimizer state while the others already hold theirs. The fused SGD kernel the
    compile door picks by default failed the trace on that mix (torch's kernel starts all of a
    group's momentum buffers or none); the group is traced single-tensor for that step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    model[0].weight.requires_grad_(False)
    twin = copy.deepcopy(model)
    cls = getattr(torch.optim, name)
    opt, ref = cls(model.parameters(), **kw), cls(twin.parameters(), **kw)
    compiled = spmd_backend.compile()(step)
    for i in range(5):
        if i == 2:
            for m in (model, twin):
                m[0].weight.requires_grad_(True)
        x = torch.randn(6, 8)
        compiled(model, opt, x)
        step(twin, ref, x)
    expected, actual = _state(twin, ref), _state(model, opt)
    assert expected.keys() == actual.keys()
    for k in expected:
        torch.testing.assert_close(actual[k], expected[k], msg=k)


def _fused_twins(name: str, lr: float) -> tuple:
    """An MLP, its eager twin, and the fused ``name`` optimizer over each (SGD with momentum)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    twin = copy.deepcopy(model)
    cls = getattr(torch.optim, name)
    kw = dict(lr=lr, fused=True) | (dict(momentum=0.9) if name == "SGD" else {})
    return model, twin, cls(model.parameters(), **kw), cls(twin.parameters(), **kw)


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW", "Adagrad"])
def test_fused_with_float64_lr_is_bitwise_eager(fake_pg, name):
    model, twin, opt, ref = _fused_twins(name, lr=0.01)
    compiled = spmd_backend.compile()(step)
    for _ in range(10):
        x = torch.randn(6, 8)
        compiled(model, opt, x)
        step(twin, ref, x)
        for o in (opt, ref):
            o.param_groups[0]["lr"] *= 0.9
    for k, v in _state(twin, ref).items():
        assert torch.equal(_state(model, opt)[k], v), k


@pytest.mark.parametrize("name", ["Adam", "AdamW", "Adamax"])
def test_foreach_on_a_float64_model_keeps_float64_step_sizes(fake_pg, name):
    """Traced in its capturable form, foreach Adam divides a float32 temporary by the float64
    lr in place; the cast back rounded the step size of a float64 model to float32 (6e-8 off
    eager after three steps until 2026-11-28, verify 40). Eager computes it in Python doubles."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()
    twin = copy.deepcopy(model)
    cls = getattr(torch.optim, name)
    opt, ref = (cls(m.parameters(), lr=0.01, foreach=True) for m in (model, twin))
    compiled = spmd_backend.compile()(step)
    for i in range(4):
        x = torch.randn(6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
        compiled(model, opt, x)
        step(twin, ref, x)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-14)


def test_zero_tests_guard_the_sign(fake_pg, caplog):
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    twin = copy.deepcopy(model)
    kw = dict(lr=0.1, momentum=0.9, weight_decay=0.01, foreach=False)
    opt, ref = torch.optim.SGD(model.parameters(), **kw), torch.optim.SGD(twin.parameters(), **kw)
    compiled = spmd_backend.compile()(step)
    with caplog.at_level(logging.WARNING, logger="spmd_backend"):
        for wd in (0.01, 0.01, 0.02, 0.0, 0.0, 0.03):
            for o in (opt, ref):
                o.param_groups[0]["weight_decay"] = wd
                o.param_groups[0]["momentum"] *= 0.99
            x = torch.randn(4, 8)
            compiled(model, opt, x)
            step(twin, ref, x)
    messages = [r.getMessage() for r in caplog.records if "retracing" in r.getMessage()]
    assert messages == [
        "spmd_backend: retracing step: param_groups[0]['weight_decay'] (lifted; the step tests "
        "it against zero) changed from a positive value to zero"
    ]
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize(
    "name,kw",
    [
        ("AdamW", dict(weight_decay=0.01)),  # default (fused when traced): betas[0] is cycled
        ("Adam", dict(fused=True)),  # explicitly fused: betas cannot be a fused kernel's input
        ("SGD", dict(momentum=0.9)),
        ("SGD", dict(momentum=0.9, foreach=True)),
        # until 2026-11-28 these two retraced every call and were refused at the 9th
        ("AdamW", dict(foreach=True)),  # betas[0] is the base of foreach's _foreach_pow
        ("SGD", dict(momentum=0.9, nesterov=True)),  # momentum is alpha= of add
    ],
)
def test_one_cycle_with_cycled_momentum_retraces_at_most_once(fake_pg, caplog, name, kw):
    """OneCycleLR (cycle_momentum=True by default) changes lr and betas[0]/momentum every step.
    A fused or foreach group is traced single-tensor after the first change, where both are
    inputs; nesterov's momentum then goes into a product (one ulp of an update off eager)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    twin = copy.deepcopy(model)
    cls = getattr(torch.optim, name)
    opt, ref = cls(model.parameters(), lr=0.01, **kw), cls(twin.parameters(), lr=0.01, **kw)
    scheds = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=20) for o in (opt, ref)]
    compiled = spmd_backend.compile()(step)
    with caplog.at_level(logging.WARNING, logger="spmd_backend"):
        for _ in range(12):
            x = torch.randn(6, 8)
            compiled(model, opt, x)
            step(twin, ref, x)
            for s in scheds:
                s.step()
    assert compiled.cache_size() <= 2 and compiled.trace_count <= 3
    retraces = [r.getMessage() for r in caplog.records if "retracing" in r.getMessage()]
    assert len(retraces) <= 1, retraces
    assert "add" not in torch.Tensor.__dict__  # nesterov's alpha= rewrite is undone
    for k, v in _state(twin, ref).items():
        torch.testing.assert_close(_state(model, opt)[k], v, msg=k)


def test_a_fused_sgd_group_its_kernel_skips_is_not_switched_to_single_tensor():
    """torch 2.13's CPU fused SGD skips every full 16 elements of bfloat16 parameters and leaves
    their momentum buffers partly unwritten (in eager too): a single-tensor step after a moving
    momentum read that memory (NaN parameters with nesterov, found in review 2026-11-28)."""
    from spmd_backend.tracing.hyperparams import unfusing_lifts

    for dtype, switched in ((torch.bfloat16, False), (torch.float32, True)):
        model = nn.Linear(8, 4).to(dtype)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True, fused=True)
        assert unfusing_lifts(opt, 0, "momentum", None) is switched, dtype


def test_cyclic_lr_with_momentum_does_not_retrace(fake_pg):
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, foreach=False)
    sched = torch.optim.lr_scheduler.CyclicLR(opt, base_lr=0.001, max_lr=0.05, step_size_up=3)
    compiled = spmd_backend.compile()(step)
    for _ in range(10):
        compiled(model, opt, torch.randn(4, 8))
        sched.step()
    assert compiled.trace_count == 2  # bootstrap (momentum buffers) + the steady graph


def _lbfgs_step(model, opt, x):
    def closure():
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    return opt.step(closure)


@pytest.mark.parametrize("door", ["compile", "dynamo"])
def test_lbfgs_is_refused_up_front(fake_pg, door):
    """Until 2026-11-28 the Dynamo door ran LBFGS's first closure, wrote ``.grad`` and its
    state, then failed on an eager gradient without naming the optimizer (hunt 41)."""
    torch._dynamo.reset()
    model = nn.Linear(8, 2)
    opt = torch.optim.LBFGS(model.parameters(), max_iter=3)
    before = [p.detach().clone() for p in model.parameters()]
    compiled = (spmd_backend.compile()(_lbfgs_step) if door == "compile" else
                torch.compile(_lbfgs_step, backend="spmd", options={"inductor": False}))
    with pytest.raises(Exception, match="LBFGS cannot be compiled") as info:
        compiled(model, opt, torch.randn(4, 8))
    assert isinstance(getattr(info.value, "inner_exception", info.value), spmd_backend.SpmdUsageError)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(p.grad is None for p in model.parameters()) and not opt.state


@pytest.mark.parametrize("foreach", [False, True])
def test_adafactor_is_refused_naming_its_code_and_runs_through_dynamo(fake_pg, foreach):
    """Adafactor's update reads tensor values in Python (``.item()`` of its step count and of
    parameter norms): the compile door cannot make one graph of it. The refusal names torch's
    line rather than telling the user to change theirs, and changes nothing; the Dynamo door
    splits the graph there and matches eager."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    twin = copy.deepcopy(model)
    opt = torch.optim.Adafactor(model.parameters(), lr=0.01, foreach=foreach)
    ref = torch.optim.Adafactor(twin.parameters(), lr=0.01, foreach=foreach)
    x = torch.randn(6, 8)
    with pytest.raises(spmd_backend.SpmdTraceError,
                       match=r"optimizer's step makes a Python decision .* at torch/optim/"
                             r"_adafactor\.py:\d+ .*torch\.compile\(step, backend=\"spmd\"\) runs it"):
        spmd_backend.compile()(step)(model, opt, x)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))
    assert all(p.grad is None for p in model.parameters()) and not opt.state
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="spmd", options={"inductor": False, "reduce_op": "sum"})
    for _ in range(3):
        x = torch.randn(6, 8)
        compiled(model, opt, x)
        step(twin, ref, x)
    expected, actual = _state(twin, ref), _state(model, opt)
    for k in expected:
        torch.testing.assert_close(actual[k], expected[k], msg=k)


def test_converting_the_model_after_some_steps_matches_eager(fake_pg):
    """``model.double()`` after the first steps converts the parameters but not the momentum
    buffers. Eager SGD promotes; the fused SGD the compile door picks by default takes one
    dtype and failed at run time before 2026-11-26. Such a group is traced single-tensor."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9)
    compiled = spmd_backend.compile()(step)
    for i in range(4):
        if i == 2:
            model.double()
            twin.double()
        x = torch.randn(6, 8, dtype=twin[0].weight.dtype)
        compiled(model, opt, x)
        step(twin, ref, x)
    expected, actual = _state(twin, ref), _state(model, opt)
    assert {v.dtype for k, v in actual.items() if k.startswith("state")} == {torch.float32}
    for k in expected:
        torch.testing.assert_close(actual[k], expected[k], msg=k)


@pytest.mark.parametrize("door", ["compile", "dynamo"])
def test_muon_matches_eager(door):
    """torch.optim.Muon: its Newton-Schulz iteration ``addmm(g, g, g)`` was re-inplaced by
    remove_copy_from_optimizer into an ``addmm_`` that overwrote its own operand: NaN after one
    step in both doors. The compile door takes one optimizer, so its model has only matrices;
    the Dynamo door's step pairs Muon with AdamW for the biases, as Muon's documentation does.
    One rank (a fake group of size 1): eager is the reference, and Muon's bf16 iteration would
    turn the fake world-2 group's halved gradients into bf16 rounding differences."""
    from spmd_backend.testing import fake_process_group

    bias = door == "dynamo"

    def optimizers(m):
        mats = [p for p in m.parameters() if p.ndim == 2]
        rest = [p for p in m.parameters() if p.ndim != 2]
        return [torch.optim.Muon(mats, lr=0.02)] + ([torch.optim.AdamW(rest, lr=0.01)] if rest else [])

    def muon_step(model, opts, x):
        loss = model(x).pow(2).mean()
        loss.backward()
        for o in opts:
            o.step()
        for o in opts:
            o.zero_grad()
        return loss.detach()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16, bias=bias), nn.Tanh(), nn.Linear(16, 4, bias=bias))
    twin = copy.deepcopy(model)
    opts, refs = optimizers(model), optimizers(twin)
    with fake_process_group(world_size=1):
        if door == "compile":
            from spmd_backend.gm_transformation import GraphModuleTransformation

            passes = GraphModuleTransformation(enable_graph_optimization=True, enable_inductor=False)
            compiled = spmd_backend.compile(gm_transformation=passes)(
                lambda model, opt, x: muon_step(model, [opt], x))
        else:
            compiled = torch.compile(muon_step, backend="spmd", options={"inductor": False})
        for _ in range(4):
            x = torch.randn(6, 8)
            compiled(model, *(opts if door == "compile" else [opts]), x)
            muon_step(twin, refs, x)
    expected, actual = _state(twin, refs[0]), _state(model, opts[0])
    for k in expected:
        torch.testing.assert_close(actual[k], expected[k], msg=k)
    if bias:
        torch.testing.assert_close(_state(model, opts[1]), _state(twin, refs[1]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kw", [dict(lr=0.05), dict(lr=0.05, momentum=0.9)], ids=["plain", "momentum"])
def test_a_low_precision_layer_is_trained_as_in_eager(fake_pg, dtype, kw):
    """torch 2.13's CPU fused SGD kernel leaves every full 16 elements of a bfloat16 or float16
    parameter unchanged. The compile door traced plain ``SGD`` with it by default, so such a
    layer was not trained at all (before 2026-11-27), silently; only float32 and float64
    groups default to fused."""
    torch.manual_seed(0)
    model = OneLowPrecisionLayer(dtype)
    twin, start = copy.deepcopy(model), copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), **kw)
    ref = torch.optim.SGD(twin.parameters(), **kw)
    compiled = spmd_backend.compile()(step)
    for _ in range(3):
        x = torch.randn(6, 8)
        compiled(model, opt, x)
        step(twin, ref, x)
    assert not torch.equal(model.b.weight, start.b.weight)
    for k, v in _state(twin, ref).items():
        torch.testing.assert_close(_state(model, opt)[k], v, msg=k)


def test_a_fused_kernel_is_traced_once_per_dtype_as_eager_calls_it(fake_pg):
    """torch's optimizers group parameters by device and dtype before a fused kernel, except
    while compiling; the trace groups them itself (one ``_fused_adamw`` per dtype)."""
    from spmd_backend.graph.ops import is_fused_optimizer

    torch.manual_seed(0)
    model = OneLowPrecisionLayer(torch.bfloat16)
    twin = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    ref = torch.optim.AdamW(twin.parameters(), lr=0.01, fused=True)
    graphs = []

    def keep(gm):
        graphs.append(gm)
        return gm

    compiled = spmd_backend.compile(gm_transformation=keep)(step)
    for _ in range(2):
        x = torch.randn(6, 8)
        compiled(model, opt, x)
        step(twin, ref, x)
    kernels = [n for n in graphs[-1].graph.nodes if is_fused_optimizer(n)]
    assert sorted(len(n.args[0]) for n in kernels) == [2, 4]
    for k, v in _state(twin, ref).items():
        torch.testing.assert_close(_state(model, opt)[k], v, msg=k)


@pytest.mark.parametrize("door", ["compile", "dynamo"])
def test_an_explicit_fused_sgd_that_skips_low_precision_parameters_is_named(door):
    """An explicit ``SGD(fused=True)`` runs torch's kernel, which leaves the bfloat16 layer
    unchanged, as in eager; both doors say so once instead of nothing."""
    from spmd_backend.testing import fake_process_group

    torch.manual_seed(0)
    model = OneLowPrecisionLayer(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, fused=True)
    with fake_process_group(world_size=1):
        compiled = (spmd_backend.compile()(step) if door == "compile" else
                    torch.compile(step, backend="spmd", options={"inductor": False}))
        with pytest.warns(UserWarning, match=r"SGD\(fused=True\) on the CPU leaves 2 "
                                             r"torch.bfloat16 parameter\(s\) \(shape \[32, 32\]"):
            compiled(model, opt, torch.randn(6, 8))
        with warnings.catch_warnings(record=True) as later:
            warnings.simplefilter("always")
            compiled(model, opt, torch.randn(6, 8))
    assert not [w for w in later if "SGD(fused=True)" in str(w.message)]  # once per optimizer


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW", "Adagrad"])
def test_a_fused_optimizer_under_a_scheduler_through_dynamo(name):
    """A float ``lr`` that changes between calls is made dynamic by Dynamo on its recompile (a
    SymFloat); the fused kernels take a tensor lr there, and the second call of any fused
    optimizer under a scheduler failed ("Expected a value of type 'Tensor' for argument 'lr'")
    before 2026-11-27."""
    from spmd_backend.testing import fake_process_group

    torch._dynamo.reset()
    model, twin, opt, ref = _fused_twins(name, lr=0.05)
    scheds = [torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.8) for o in (opt, ref)]
    with fake_process_group(world_size=1):
        compiled = torch.compile(step, backend="spmd", options={"inductor": False})
        for _ in range(4):
            x = torch.randn(6, 8)
            compiled(model, opt, x)
            step(twin, ref, x)
            for s in scheds:
                s.step()
    for k, v in _state(twin, ref).items():
        torch.testing.assert_close(_state(model, opt)[k], v, msg=k)


@pytest.mark.parametrize("door", ["compile", "dynamo"])
@pytest.mark.parametrize("kw", [dict(), dict(amsgrad=True, weight_decay=0.1)], ids=["plain", "amsgrad"])
def test_single_tensor_adam_from_lr_zero_keeps_zero_gradient_elements(door, kw):
    """A warmup that starts at lr = 0 (transformers' schedules) and parameters whose gradient
    is exactly zero (dead ReLU units): torch 2.13's capturable single-tensor Adam, which every
    traced step runs, computed ``0 / -0.0`` and wrote NaN into them in both doors (stock
    ``torch.compile`` too, pytorch#126514) where eager leaves them unchanged. Since 2026-11-28
    the update has eager's form (spmd_backend/tracing/adam_denominator.py)."""
    from spmd_backend.testing import fake_process_group
    from spmd_backend.testing.steps import compiled_by

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
    with torch.no_grad():
        model[0].bias[:8] = -100.0  # eight units that never fire: their gradients are zero
    twin = copy.deepcopy(model)
    opt, ref = (torch.optim.AdamW(m.parameters(), lr=0.01, foreach=False, **kw) for m in (model, twin))
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda i: min(1.0, i / 3)) for o in (opt, ref)]
    with fake_process_group(world_size=1):
        compiled = compiled_by(door, step)
        for i in range(4):
            x = torch.randn(6, 8, generator=torch.Generator().manual_seed(i))
            compiled(model, opt, x)
            step(twin, ref, x)
            for s in scheds:
                s.step()
            assert not any(p.isnan().any() for p in model.parameters()), f"NaN after call {i}"
    expected, actual = _state(twin, ref), _state(model, opt)
    for k in expected:
        torch.testing.assert_close(actual[k], expected[k], msg=k)
