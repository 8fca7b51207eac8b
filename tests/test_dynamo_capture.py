"""Whole-step capture is scoped to frames compiled for backend="spmd".

In one fresh process: a stock ``torch.compile(step, backend="eager")`` is measured (graphs,
graph breaks, result), the spmd backend is used for a few steps, and the stock compile is
measured again: it must behave exactly as before, and every adjusted Dynamo method and config
must be back to torch's own.
"""

from __future__ import annotations

import copy
import json
import logging
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import spmd_backend
from spmd_backend import SpmdUsageError
from spmd_backend.testing.steps import train_step

SCRIPT = textwrap.dedent(
    """
    import json, tempfile, torch, torch.distributed as dist
    from torch._dynamo.utils import counters
    from torch._dynamo.output_graph import OutputGraph
    from torch._dynamo.variables.functions import SkipFunctionVariable
    from torch._dynamo.variables.builtin import SetAttrBuiltinVariable
    from torch._dynamo.variables.optimizer import OptimizerVariable
    from torch._dynamo.variables.tensor import TensorVariable
    from torch._dynamo.side_effects import SideEffects
    from torch._dynamo.guards import GuardBuilder

    def step(model, opt, x):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    def run(backend, **kw):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        compiled = torch.compile(step, backend=backend, **kw)
        for i in range(3):
            compiled(model, opt, torch.full((4, 8), float(i)))
        return {
            "graphs": counters["stats"]["unique_graphs"],
            "breaks": sum(counters["graph_break"].values()),
            "sum": round(float(sum(p.sum() for p in model.parameters())), 5),
        }

    def methods():
        return [id(SkipFunctionVariable.call_function), id(OptimizerVariable.call_method),
                id(TensorVariable.method_backward), id(OptimizerVariable.var_getattr),
                id(SideEffects.store_attr), id(TensorVariable.method_attr_grad),
                id(TensorVariable.method_attr_requires_grad),
                id(OutputGraph._validate_outputs_safe_for_autograd_nodes),
                id(SetAttrBuiltinVariable._call_setattr),
                id(GuardBuilder.EMPTY_NN_MODULE_HOOKS_DICT),
                torch._dynamo.config.trace_autograd_ops]

    stock_before, methods_before = run("eager"), methods()
    dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
    spmd = run("spmd", options={"inductor": False})
    spmd["whole_step_graphs"] = counters["spmd"]["whole_step_graphs"]
    stock_after, methods_after = run("eager"), methods()
    dist.destroy_process_group()
    print(json.dumps({"before": stock_before, "spmd": spmd, "after": stock_after,
                      "methods_restored": methods_before == methods_after}))
    """
)


def test_stock_torch_compile_is_unaffected_by_the_spmd_backend():
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["after"] == out["before"], out
    assert out["methods_restored"], out
    assert out["before"]["breaks"] > 0, "stock Dynamo breaks this step; the test must see it"
    assert out["spmd"]["breaks"] == 0 and out["spmd"]["whole_step_graphs"] == 2, out
    assert out["spmd"]["sum"] == out["before"]["sum"], out  # one rank: same training


def test_none_and_true_stay_constants_after_reading_grad(fake_pg):
    """torch 2.13 gave its shared None constant the source of the first ``p.grad`` (None) a
    frame read, and every later None of the process was rebuilt from that gradient: this
    step's ``"aux": None`` came back as a parameter's gradient from the second call on."""
    import torch
    import torch.nn as nn
    from torch._dynamo.variables import constant

    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(model, opt, x):
        opt.zero_grad()  # reads each .grad: None on the first call
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        return {"loss": loss, "aux": None, "flag": True}

    compiled = torch.compile(step, backend="spmd", options={"inductor": False})
    for _ in range(3):
        out = compiled(model, opt, torch.randn(8, 4))
        assert out["aux"] is None and out["flag"] is True, out
    shared = (constant.CONSTANT_VARIABLE_NONE, constant.CONSTANT_VARIABLE_TRUE,
              constant.CONSTANT_VARIABLE_FALSE)
    assert all(c.source is None for c in shared), [c.source for c in shared]


def manual_sgd_step(model, x):
    loss = model(x).pow(2).mean()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad  # rebinds p to the in-place result
            p.grad = None
    return loss.detach()


@pytest.mark.parametrize("door", ["compile", "dynamo"])
def test_hand_written_sgd_clears_its_gradients(fake_pg, door):
    """torch 2.13's Dynamo dropped ``p.grad = None`` after ``p -= lr * p.grad``: the gradients
    stayed and the next backward accumulated onto them (0.13 off DDP after four steps through
    backend="spmd"; plain torch.compile has the same bug). The scope sends the store to the
    parameter's own variable."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    twin = copy.deepcopy(model)
    compiled = (spmd_backend.compile()(manual_sgd_step) if door == "compile" else
                torch.compile(manual_sgd_step, backend="spmd",
                              options={"inductor": False, "reduce_op": "sum"}))
    for _ in range(3):
        x = torch.randn(4, 8)
        compiled(model, x)
        manual_sgd_step(twin, x)
        assert all(p.grad is None for p in model.parameters())
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)


def data_update_step(model, x):
    loss = model(x).pow(2).mean()
    loss.backward()
    for p in model.parameters():
        p.data.add_(p.grad, alpha=-0.1)
        p.grad.zero_()
    return loss.detach()


def test_data_update_with_gradient_zeroing_is_refused_before_it_runs(fake_pg):
    """Once the gradients exist, torch 2.13's AOTAutograd mis-orders the input mutations of
    this graph: the call failed after writing the first parameter. It is refused while
    compiling, with nothing changed; the compile door runs it."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    twin = copy.deepcopy(model)
    compiled = torch.compile(data_update_step, backend="spmd",
                             options={"inductor": False, "reduce_op": "sum"})
    x = torch.randn(4, 8)
    compiled(model, x)  # no gradients yet: its graph does not mutate one
    data_update_step(twin, x)
    before = [(p.detach().clone(), p.grad.clone()) for p in model.parameters()]
    with pytest.raises(Exception, match=r"updates '0.weight' through .data in place") as info:
        compiled(model, torch.randn(4, 8))
    assert isinstance(getattr(info.value, "inner_exception", info.value), SpmdUsageError)
    for (w, g), p in zip(before, model.parameters()):
        assert torch.equal(w, p) and torch.equal(g, p.grad)
    door = spmd_backend.compile()(data_update_step)  # the compile door runs it
    for _ in range(2):
        x = torch.randn(4, 8)
        door(model, x)
        data_update_step(twin, x)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)


@pytest.mark.parametrize("kind", ["forward", "forward_pre", "full_backward"])
def test_a_module_hook_added_after_compiling_runs(fake_pg, kind):
    """torch 2.13's Dynamo does not guard a module's empty hook dicts by default
    (``skip_nnmodule_hook_guards``): a hook registered after the first calls was never run by the
    cached graph (1.9e-2 off DDP after one step). Through backend="spmd" it recompiles, and
    recompiles again when the hook is removed. A full backward hook makes Dynamo run the module
    outside its graphs: the gradient audit raises instead of training unsynchronized."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)

    def register(module):
        if kind == "forward":
            return module[0].register_forward_hook(lambda m, i, o: o * 2)
        if kind == "forward_pre":
            return module[2].register_forward_pre_hook(lambda m, a: (a[0] * 0.5,))
        return module[2].register_full_backward_hook(lambda m, gi, go: (gi[0] * 3,))

    compiled = torch.compile(train_step, backend="spmd", options={"inductor": False, "reduce_op": "sum"})
    handles = []
    for i in range(5):
        if i == 2:
            handles = [register(model), register(twin)]
            if kind == "full_backward":
                with pytest.raises(SpmdUsageError, match=r"gradient of parameter '2\.\w+' was "
                                                         r"computed outside"):
                    compiled(model, opt, torch.randn(4, 8))
                return
        if i == 4:
            for h in handles:
                h.remove()
        x = torch.randn(4, 8)
        torch.testing.assert_close(compiled(model, opt, x), train_step(twin, ref, x), msg=f"call {i}")
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)


def test_a_global_module_hook_registered_after_compiling_is_reported(fake_pg, caplog):
    """Dynamo does not guard global module hooks, so a graph keeps running the ones it was
    compiled with. The backend cannot recompile from a call; it says so once, naming the kind."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    compiled = torch.compile(train_step, backend="spmd", options={"inductor": False, "reduce_op": "sum"})
    with caplog.at_level(logging.WARNING, logger="spmd_backend"):
        compiled(model, opt, torch.randn(4, 8))
        assert not [r for r in caplog.records if "global module hooks" in r.getMessage()]
        handle = nn.modules.module.register_module_forward_hook(lambda m, i, o: o)
        try:
            for _ in range(2):
                compiled(model, opt, torch.randn(4, 8))
        finally:
            handle.remove()
    warnings = [r.getMessage() for r in caplog.records if "global module hooks" in r.getMessage()]
    assert len(warnings) == 1 and "(global forward hook) were registered or removed" in warnings[0]
