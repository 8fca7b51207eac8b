"""A cached graph is reused only for what it baked in (one process, fake process group).

Each test changes one fact a user can change between calls (module mode, a module attribute,
a hook, grad mode, autocast, a non-lifted hyper-parameter, a batch entry the step reads) and
checks that the step retraces with one log line naming it and then matches eager; facts the
step never reads (a dataset's ``idx``) must not retrace.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import logging
import types

import pytest
import torch
import torch.nn as nn

import spmd_backend
from spmd_backend import SpmdTraceError, SpmdUsageError
from spmd_backend.testing.steps import train_step as step


class DropNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.drop = nn.Dropout(0.5)
        self.bn = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 2)
        self.scale = 1.0

    def forward(self, x):
        return self.fc2(self.bn(self.drop(self.fc1(x)))) * self.scale

#: what a retrace names after a Python number argument changed
NUMBER_HINT = (" (a Python number is a constant of the graph: pass one that changes from call to "
               "call as a tensor, e.g. torch.tensor(x), and it is an input instead)")


def retrace_messages(caplog):
    return [r.getMessage() for r in caplog.records if "retracing" in r.getMessage()]


def test_eval_after_train_retraces_and_matches_eager(fake_pg, caplog):
    torch.manual_seed(0)
    model = DropNorm()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = spmd_backend.compile()(step)
    x = torch.randn(8, 8)
    model.train()
    compiled(model, opt, x)
    twin = copy.deepcopy(model)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    model.eval()
    twin.eval()
    with caplog.at_level(logging.WARNING, logger="spmd_backend"):
        loss = compiled(model, opt, x)
    expected = step(twin, twin_opt, x)
    torch.testing.assert_close(loss, expected)  # no dropout, running statistics
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)
    assert retrace_messages(caplog) == [
        "spmd_backend: retracing train_step: the model switched from train to eval mode (model.eval())"
    ]
    model.train()
    compiled(model, opt, x)  # back to the cached train graph
    assert compiled.trace_count == 2


def train_mode_step(model, optim, x):
    model.train()  # as many training loops begin their step
    return step(model, optim, x)


def test_model_train_inside_the_step_is_repeated_by_every_call(fake_pg, caplog):
    """A validation pass leaves the model in eval mode; the step switches it back. The compiled
    graph's replays ran no Python, so the model stayed in eval mode after the call (eager leaves
    it in train mode), and code after the step saw the wrong mode."""
    torch.manual_seed(0)
    model = DropNorm()
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    compiled = spmd_backend.compile()(train_mode_step)
    with caplog.at_level(logging.WARNING, logger="spmd_backend"):
        for i in range(4):
            model.eval()
            twin.eval()
            x = torch.randn(8, 8)
            torch.manual_seed(i)
            loss = compiled(model, opt, x)
            torch.manual_seed(i)
            torch.testing.assert_close(loss, train_mode_step(twin, twin_opt, x))
            assert [m.training for m in model.modules()] == [True] * 5, i
    assert compiled.trace_count == 1  # traced once (eval at the call), replayed three times
    assert not [r for r in caplog.records if "changed what it reads" in r.getMessage()]
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)


def test_one_submodule_switching_mode_is_named(fake_pg, caplog):
    model = DropNorm()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = spmd_backend.compile()(step)
    compiled(model, opt, torch.randn(8, 8))
    model.drop.eval()
    with caplog.at_level(logging.WARNING, logger="spmd_backend"):
        compiled(model, opt, torch.randn(8, 8))
    assert retrace_messages(caplog) == [
        "spmd_backend: retracing train_step: module 'drop' switched from train to eval mode"
    ]


def _compiled_and_eager_twin(model):
    """``model`` and an eager twin, each with SGD, after one call of each on the same batch."""
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    compiled = spmd_backend.compile()(step)
    x = torch.randn(8, 8)
    compiled(model, opt, x)
    step(twin, twin_opt, x)
    return model, twin, opt, twin_opt, compiled, x


def test_module_attributes_and_hooks_are_part_of_the_key(fake_pg, caplog):
    torch.manual_seed(0)
    model, twin, opt, twin_opt, compiled, x = _compiled_and_eager_twin(DropNorm().eval())
    with caplog.at_level(logging.WARNING, logger="spmd_backend"):
        model.scale = twin.scale = 3.0  # a plain attribute read by forward
        torch.testing.assert_close(compiled(model, opt, x), step(twin, twin_opt, x))
        for m in (model, twin):  # a forward hook that changes the output
            m.fc1.register_forward_hook(lambda mod, args, out: out * 0.5)
        torch.testing.assert_close(compiled(model, opt, x), step(twin, twin_opt, x))
    assert retrace_messages(caplog) == [
        "spmd_backend: retracing train_step: attribute <root>.scale changed from 1.0 to 3.0",
        "spmd_backend: retracing train_step: the hooks of module 'fc1' changed",
    ]


class Mixture(nn.Module):
    """Mixing weights in a public list and a scale in a public dict, read by forward."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 1), nn.Linear(8, 1)
        self.mix = [0.5, 0.5]
        self.options = {"scale": 1.0}

    def forward(self, x):
        return (self.mix[0] * self.a(x) + self.mix[1] * self.b(x)) * self.options["scale"]


def test_public_list_and_dict_attributes_are_part_of_the_key(fake_pg, caplog):
    """Before: a module's lists and dicts were skipped as module internals, and changing
    ``model.mix[0]`` left the replay on the old weights (0.048 off eager one call later)."""
    torch.manual_seed(0)
    model, twin, opt, twin_opt, compiled, x = _compiled_and_eager_twin(Mixture())
    with caplog.at_level(logging.WARNING, logger="spmd_backend"):
        for m in (model, twin):
            m.mix[0] = 0.9
        torch.testing.assert_close(compiled(model, opt, x), step(twin, twin_opt, x))
        for m in (model, twin):
            m.options["scale"] = 3.0
        torch.testing.assert_close(compiled(model, opt, x), step(twin, twin_opt, x))
    assert retrace_messages(caplog) == [
        "spmd_backend: retracing train_step: attribute <root>.mix changed from [0.5, 0.5] to "
        "[0.9, 0.5]",
        "spmd_backend: retracing train_step: attribute <root>.options changed from "
        "{'scale': 1.0} to {'scale': 3.0}",
    ]
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)


class Configured(nn.Module):
    """Settings kept where people keep them: an activation function as an attribute, a set of
    switched-off branches, an option two objects deep (``self.run.opts.scale``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 4), nn.Linear(8, 4)
        self.act = torch.relu
        self.skip: set[str] = set()
        self.run = types.SimpleNamespace(opts=types.SimpleNamespace(scale=1.0))

    def forward(self, x):
        h = self.act(self.a(x)) * self.run.opts.scale
        return h if "b" in self.skip else h + self.b(x)


@pytest.mark.parametrize("change, message", [
    (lambda m: setattr(m, "act", torch.tanh), "attribute <root>.act changed from torch.relu to torch.tanh"),
    (lambda m: m.skip.add("b"), "attribute <root>.skip changed from set() to {'b'}"),
    (lambda m: setattr(m.run.opts, "scale", 3.0),
     "attribute run.opts.scale changed from 1.0 to 3.0"),
])
def test_functions_sets_and_nested_options_are_part_of_the_key(fake_pg, caplog, change, message):
    """Each was outside the key before 2026-11-27: the replay kept the traced activation,
    branch or scale (0.02-0.03 off DDP after 5 Adam steps, 2 ranks)."""
    torch.manual_seed(0)
    model, twin, opt, twin_opt, compiled, x = _compiled_and_eager_twin(Configured())
    with caplog.at_level(logging.WARNING, logger="spmd_backend"):
        change(model)
        change(twin)
        torch.testing.assert_close(compiled(model, opt, x), step(twin, twin_opt, x))
    assert retrace_messages(caplog) == [f"spmd_backend: retracing train_step: {message}"]
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)


class Kept(nn.Module):
    """Settings the key missed until 2026-11-28 (hunt 45): a numpy scalar, a list inside a dict,
    a private list, and a parameter-free submodule that can be swapped for another class."""

    def __init__(self) -> None:
        import numpy as np

        super().__init__()
        self.a = nn.Linear(8, 4)
        self.act = nn.ReLU()
        self.gain = np.float32(1.0)
        self.cfg = {"scales": [1.0, 2.0]}
        self._w = [1.0]

    def forward(self, x):
        return self.act(self.a(x)) * float(self.gain) * self.cfg["scales"][0] * self._w[0]


def _set_gain(m):
    import numpy as np

    m.gain = np.float32(3.0)


@pytest.mark.parametrize("change, message", [
    (_set_gain, "attribute <root>.gain changed from ('numpy', 'float32', 1.0) to "
                "('numpy', 'float32', 3.0)"),
    (lambda m: m.cfg["scales"].__setitem__(0, 3.0), "attribute <root>.cfg changed"),
    (lambda m: m._w.__setitem__(0, 3.0), "attribute <root>._w changed from [1.0] to [3.0]"),
    (lambda m: setattr(m, "act", nn.SiLU()), "attribute act.__class__ changed from"),
])
def test_numpy_nested_private_and_class_facts_are_part_of_the_key(fake_pg, caplog, change,
                                                                  message):
    """Each replayed the old value, silently (0.008-0.027 off eager after one or two calls)."""
    torch.manual_seed(0)
    model, twin, opt, twin_opt, compiled, x = _compiled_and_eager_twin(Kept())
    with caplog.at_level(logging.WARNING, logger="spmd_backend"):
        change(model)
        change(twin)
        torch.testing.assert_close(compiled(model, opt, x), step(twin, twin_opt, x))
    (retrace,) = retrace_messages(caplog)
    assert retrace.startswith(f"spmd_backend: retracing train_step: {message}"), retrace
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)


def _linear_twins(fn):
    """A linear model, its eager twin, their SGDs and ``fn`` compiled."""
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    twin = copy.deepcopy(model)
    opt, twin_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, twin))
    return model, twin, opt, twin_opt, spmd_backend.compile()(fn)


def options_step(model, optim, x, opts):
    """A step configured by an object argument holding a loss function."""
    loss = opts.loss(model(x), torch.zeros(x.shape[0], 2)) * opts.w
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


class _Double(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out * 2 if func is torch.nn.functional.linear else out


def test_object_arguments_defaults_and_function_modes_are_part_of_the_key(fake_pg):
    """Keyed by identity only, an object argument changed in place (``argparse.Namespace``,
    ``SimpleNamespace``) and a new ``functools.partial`` landing at a freed address replayed
    the old graph; a mutable default and a TorchFunctionMode around the call were not keyed at
    all (hunt 45: 0.005-0.45 off eager)."""
    import functools

    import torch.nn.functional as F

    model, twin, opt, twin_opt, compiled = _linear_twins(options_step)
    opts = types.SimpleNamespace(w=1.0, loss=functools.partial(F.smooth_l1_loss, beta=1.0))
    changes = [
        lambda: None,
        lambda: setattr(opts, "w", 3.0),
        lambda: setattr(opts, "loss", functools.partial(F.smooth_l1_loss, beta=0.1)),
        lambda: setattr(opts, "loss", functools.partial(F.smooth_l1_loss, beta=2.0)),
    ]
    for i, change in enumerate(changes):
        change()
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
        torch.testing.assert_close(compiled(model, opt, x, opts), options_step(twin, twin_opt, x, opts),
                                   msg=f"call {i}")
    with _Double():  # entered around the call
        x = torch.randn(4, 8)
        torch.testing.assert_close(compiled(model, opt, x, opts), options_step(twin, twin_opt, x, opts))
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)


def _default_step(model, optim, x, cfg={"w": 1.0}):  # noqa: B006 - the mutable default is the case
    loss = model(x).pow(2).mean() * cfg["w"]
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


def test_a_default_changed_in_place_retraces(fake_pg, caplog):
    model, twin, opt, twin_opt, compiled = _linear_twins(_default_step)
    with caplog.at_level(logging.WARNING, logger="spmd_backend"):
        for i in range(3):
            if i == 2:
                _default_step.__defaults__[0]["w"] = 3.0
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
            torch.testing.assert_close(compiled(model, opt, x), _default_step(twin, twin_opt, x))
    _default_step.__defaults__[0]["w"] = 1.0
    assert any("defaults changed" in m for m in retrace_messages(caplog)), caplog.text


def test_float32_matmul_precision_is_part_of_the_key(fake_pg, caplog):
    """Inductor generates its matmuls for the precision set when it compiles (TF32 on GPUs): a
    precision changed between calls retraces instead of keeping the old kernels."""
    torch.manual_seed(0)
    model, twin, opt, twin_opt, compiled, x = _compiled_and_eager_twin(Mixture())
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high" if before != "high" else "medium")
        with caplog.at_level(logging.WARNING, logger="spmd_backend"):
            torch.testing.assert_close(compiled(model, opt, x), step(twin, twin_opt, x))
        after = torch.get_float32_matmul_precision()
    finally:
        torch.set_float32_matmul_precision(before)
    assert retrace_messages(caplog) == [
        "spmd_backend: retracing train_step: torch.get_float32_matmul_precision() changed from "
        f"{before!r} to {after!r}"
    ]


def test_grad_mode_and_autocast_are_part_of_the_key(fake_pg, caplog):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    compiled = spmd_backend.compile()(step)
    x = torch.randn(8, 8)
    compiled(model, opt, x)
    step(twin, twin_opt, x)
    with caplog.at_level(logging.WARNING, logger="spmd_backend"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = compiled(model, opt, x)
            expected = step(twin, twin_opt, x)
    assert loss.dtype == expected.dtype
    torch.testing.assert_close(loss, expected)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)
    assert retrace_messages(caplog) == [
        "spmd_backend: retracing train_step: autocast on cpu (enabled, dtype) changed from "
        "(False, torch.bfloat16) to (True, torch.bfloat16)"
    ]


def test_non_lifted_hyperparameter_change_is_named(fake_pg, caplog):
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    twin = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    twin_opt = torch.optim.Adam(twin.parameters(), lr=0.01)
    compiled = spmd_backend.compile()(step)
    for _ in range(2):
        x = torch.randn(4, 8)
        compiled(model, opt, x)
        step(twin, twin_opt, x)
    for o in (opt, twin_opt):
        o.param_groups[0]["maximize"] = True  # read by the step, never lifted
    with caplog.at_level(logging.WARNING, logger="spmd_backend"):
        x = torch.randn(4, 8)
        compiled(model, opt, x)
        step(twin, twin_opt, x)
    assert retrace_messages(caplog) == [
        "spmd_backend: retracing train_step: param_groups[0]['maximize'] (read by the step) changed "
        "from False to True"
    ]
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)


def test_group_entries_the_step_never_reads_do_not_retrace(fake_pg):
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    compiled = spmd_backend.compile()(step)
    for i in range(6):
        opt.param_groups[0]["last_logged_loss"] = float(i)  # bookkeeping some trainers keep
        compiled(model, opt, torch.randn(4, 8))
    assert compiled.trace_count == 2  # bootstrap (momentum buffers) + one steady graph


# ----------------------------------------------------------------------------- batches
def dict_step(model, optim, batch):
    loss = model(batch["x"]).pow(2).mean() * batch["weight"]
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def test_unread_batch_entries_do_not_retrace(fake_pg):
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    compiled = spmd_backend.compile()(dict_step)
    for i in range(12):  # more calls than max_graphs
        batch = {"x": torch.randn(4, 8), "weight": 1.0, "idx": i, "source": f"shard-{i % 5}"}
        compiled(model, opt, batch)
    assert compiled.trace_count == 1


def test_read_batch_entries_retrace_and_are_named(fake_pg, caplog):
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    compiled = spmd_backend.compile()(dict_step)
    with caplog.at_level(logging.WARNING, logger="spmd_backend"):
        for weight in (1.0, 1.0, 0.5):
            batch = {"x": torch.randn(4, 8), "weight": weight, "idx": 7}
            torch.testing.assert_close(compiled(model, opt, batch), dict_step(twin, twin_opt, batch))
    assert compiled.trace_count == 2
    assert retrace_messages(caplog) == [
        "spmd_backend: retracing dict_step: argument args[2]['weight'] (read by the step) "
        "changed from 1.0 to 0.5" + NUMBER_HINT
    ]
    # what the hint says: as a tensor, the weight is an input (one graph for every value)
    for weight in (1.0, 0.5, 0.25):
        batch = {"x": torch.randn(4, 8), "weight": torch.tensor(weight), "idx": 7}
        torch.testing.assert_close(compiled(model, opt, batch), dict_step(twin, twin_opt, batch))
    assert compiled.trace_count == 3
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)


def test_iterating_a_batch_reads_every_entry(fake_pg):
    def summing_step(model, optim, batch):
        scale = sum(v for k, v in batch.items() if k != "x")
        loss = model(batch["x"]).pow(2).mean() * scale
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    compiled = spmd_backend.compile()(summing_step)
    compiled(model, opt, {"x": torch.randn(4, 8), "a": 1.0, "b": 2.0})
    compiled(model, opt, {"x": torch.randn(4, 8), "a": 1.0, "b": 3.0})
    assert compiled.trace_count == 2


class Encoding(collections.UserDict):
    """Like transformers' BatchEncoding: a UserDict that pytree does not know."""

    def __init__(self, data, note):
        super().__init__(data)
        self.note = note


def test_user_dict_batches_are_mappings(fake_pg):
    def enc_step(model, optim, batch):
        assert isinstance(batch, Encoding) and batch.note == "kept"
        loss = model(batch["x"]).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    compiled = spmd_backend.compile()(enc_step)
    for i in range(4):
        compiled(model, opt, Encoding({"x": torch.randn(4, 8), "idx": i}, "kept"))
    assert compiled.trace_count == 1
    assert any(n.startswith("a_args_2___x") for n in compiled.graph.traced.placeholder_names)


@dataclasses.dataclass(frozen=True)
class Batch:
    x: torch.Tensor
    y: torch.Tensor
    weight: float = 1.0
    note: str = "kept"


def test_dataclass_batches_are_their_fields(fake_pg, caplog):
    """Before: a dataclass batch was one opaque leaf, and its tensors were refused as captured
    from an enclosing scope. Its fields are now arguments: tensors graph inputs, the rest keyed
    by value (``batch.weight`` changed: one retrace naming it)."""
    def dc_step(model, optim, batch):
        assert isinstance(batch, Batch) and batch.note == "kept"
        loss = (model(batch.x) - batch.y).pow(2).mean() * batch.weight
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    model, twin, opt, twin_opt, compiled = _linear_twins(dc_step)
    with caplog.at_level(logging.WARNING, logger="spmd_backend"):
        for i in range(4):
            batch = Batch(torch.randn(4, 8), torch.randn(4, 2), 1.0 if i < 2 else 5.0)
            torch.testing.assert_close(compiled(model, opt, batch), dc_step(twin, twin_opt, batch))
    assert [m.split(": ", 2)[2] for m in retrace_messages(caplog)] == [
        "argument args[2].weight changed from 1.0 to 5.0" + NUMBER_HINT]
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)


# ----------------------------------------------------------------------------- errors
def test_item_in_the_step_names_the_users_line(fake_pg):
    def item_step(model, optim, batch):
        loss = model(batch).pow(2).mean()
        if loss.item() > 100.0:  # the offending line
            loss = loss * 0.1
        loss.backward()
        optim.step()
        return loss

    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(SpmdTraceError, match="Python decision on a tensor's value") as info:
        spmd_backend.compile()(item_step)(model, opt, torch.randn(4, 8))
    assert "test_cache_key.py" in str(info.value)
    assert "`if loss.item() > 100.0:  # the offending line`" in str(info.value)


def test_python_side_effects_in_forward_hit_the_limit_with_the_reason(fake_pg):
    class Counting(nn.Linear):
        def forward(self, x):
            self.calls = getattr(self, "calls", 0) + 1  # a Python side effect per forward
            return super().forward(x)

    model = Counting(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    compiled = spmd_backend.compile(max_graphs=3)(step)
    with pytest.raises(SpmdUsageError, match=r"attribute <root>\.calls changed from 2 to 3"):
        for _ in range(5):
            compiled(model, opt, torch.randn(4, 8))


class CountingSGD(torch.optim.Optimizer):
    """SGD whose step size decays with a Python counter kept on the optimizer object."""

    def __init__(self, params, lr):
        super().__init__(params, dict(lr=lr))
        self.k = 0

    @torch.no_grad()
    def step(self):
        self.k += 1
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] / self.k)


def _counting_run(compiled, calls=4):
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    twin = copy.deepcopy(model)
    opt, twin_opt = CountingSGD(model.parameters(), 0.1), CountingSGD(twin.parameters(), 0.1)
    for i in range(calls):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
        compiled(model, opt, x)
        step(twin, twin_opt, x)
    assert opt.k == twin_opt.k == calls
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)


def test_optimizer_python_attribute_is_part_of_the_key(fake_pg, caplog):
    """A custom optimizer's ``self.k += 1`` runs only while a step is traced: a replayed graph
    would keep the traced ``k`` (trained wrong, before the fix). The optimizer's plain
    attributes are keyed, so each call retraces, with the reason."""
    with caplog.at_level(logging.WARNING, logger="spmd_backend"):
        _counting_run(spmd_backend.compile()(step))
    assert "attribute <optimizer CountingSGD>.k changed from 1 to 2" in " ".join(
        retrace_messages(caplog))


def test_optimizer_python_attribute_through_dynamo(fake_pg):
    """torch 2.13's Dynamo dropped attribute stores on an optimizer (its ``self.k`` stayed 0
    and the graph kept the first call's value); they are replayed after each call now."""
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="spmd", options={"inductor": False, "reduce_op": "sum"})
    _counting_run(compiled)


def _warmup_step(model, opt, x, it):
    for group in opt.param_groups:  # a hand-written warmup, inside the step
        group["lr"] = 0.05 * min(1.0, (it + 1) / 3)
        group.pop("initial_lr", None)  # a removal makes Dynamo rebuild the whole group
    return step(model, opt, x)


@pytest.mark.parametrize("make_opt", [lambda p: torch.optim.AdamW(p, lr=0.05),
                                      lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)],
                         ids=["adamw", "sgd"])
@pytest.mark.parametrize("pop", [False, True], ids=["update", "rebuild"])
def test_a_step_that_writes_its_param_groups_leaves_capturable_alone(fake_pg, make_opt, pop):
    """Dynamo traces the optimizer with ``capturable=True`` in its copy of the param groups;
    a step writing ``g["lr"]`` had that copy replayed onto the user's groups (an eager AdamW on
    the CPU then refused to step; SGD gained the key), and so did one removing a key (Dynamo
    then rebuilds the group). The groups keep their own value, the step's writes arrive, and the
    parameters match eager's."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    twin = copy.deepcopy(model)
    opt, twin_opt = make_opt(model.parameters()), make_opt(twin.parameters())
    before = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    if pop:
        for o in (opt, twin_opt):
            o.param_groups[0]["initial_lr"] = 0.05
    compiled = torch.compile(_warmup_step, backend="spmd",
                             options={"inductor": False, "reduce_op": "sum"})
    for it in range(4):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(it))
        compiled(model, opt, x, it)
        _warmup_step(twin, twin_opt, x, it)
    after = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    assert after == {**before, "lr": 0.05}, after
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)
    twin_opt.load_state_dict(opt.state_dict())  # the checkpoint resumes in eager
    step(twin, twin_opt, torch.randn(4, 8))


def test_lr_scheduler_bookkeeping_does_not_retrace(fake_pg, caplog):
    """An LR scheduler's ``_opt_called`` flag (set on the optimizer by the first step) is not
    a reason to retrace."""
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    compiled = spmd_backend.compile()(step)
    with caplog.at_level(logging.WARNING, logger="spmd_backend"):
        for _ in range(3):
            compiled(model, opt, torch.randn(4, 8))
            sched.step()
    assert getattr(opt, "_opt_called", False)
    assert compiled.trace_count == 1, retrace_messages(caplog)


class Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.fc = nn.Linear(8, 2)

    def forward(self, ids):
        return self.fc(self.emb(ids).mean(1))


def test_a_size_that_changes_names_how_to_trace_it_symbolically(fake_pg, caplog):
    torch.manual_seed(0)
    model = Tokens()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = spmd_backend.compile()(step)
    compiled(model, opt, torch.randint(0, 16, (4, 5)))
    with caplog.at_level(logging.WARNING, logger="spmd_backend"):
        compiled(model, opt, torch.randint(0, 16, (4, 7)))  # a padded length changed
        compiled(model, opt, torch.randint(0, 16, (6, 7)))  # a batch size changed
    first, second = retrace_messages(caplog)
    assert "shape=[4, 5]" in first and "shape=[4, 7]" in first, first
    assert "spmd_backend.mark_dynamic(tensor, [1]) on each call's tensor" in first, first
    assert "dynamic_batch=True" in second and "mark_dynamic" not in second, second
    # following the hint: one graph for every length (0 and 1 stay specialized)
    twin = copy.deepcopy(model)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    marked = spmd_backend.compile()(step)
    for n in (5, 7, 9):
        ids = torch.randint(0, 16, (4, n))
        loss = marked(model, opt, spmd_backend.mark_dynamic(ids, [1]))
        torch.testing.assert_close(loss, step(twin, twin_opt, ids))
    assert marked.cache_size() == 1


class _Tokens(nn.Module):
    """A (batch, tokens, features) input through Linear layers: the trace views it as 2-D."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))).mean(1)


def test_a_batch_laid_out_differently_retraces_and_matches_eager(fake_pg, caplog):
    """Same shape, other strides (a slice of a wider tensor, a transpose): until 2026-11-28 the
    call failed in the replayed graph's ``view`` instead of retracing."""
    torch.manual_seed(0)
    model = _Tokens()
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    compiled = spmd_backend.compile()(step)
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(4, 5, 12, generator=gen)
    batches = [wide[..., :8].contiguous(), wide[..., :8], wide[..., 4:].clone(),
               torch.randn(5, 4, 8, generator=gen).transpose(0, 1)]
    with caplog.at_level(logging.WARNING, logger="spmd_backend"):
        for x in batches:
            torch.testing.assert_close(compiled(model, opt, x), step(twin, twin_opt, x))
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)
    assert compiled.trace_count == 3  # contiguous (twice), the slice, the transpose
    assert retrace_messages(caplog)[0] == (
        "spmd_backend: retracing train_step: argument args[2] changed from tensor(shape=[4, 5, 8], "
        "dtype=torch.float32, device=cpu, requires_grad=False) to tensor(shape=[4, 5, 8], "
        "dtype=torch.float32, device=cpu, requires_grad=False, strides=[60, 12, 1])")


def test_graphs_of_models_that_are_gone_do_not_count_against_max_graphs(fake_pg):
    """A new model and optimizer per fold: each traces its own graph. Until 2026-11-28 the
    fold past ``max_graphs`` was refused although the earlier models were gone."""
    compiled = spmd_backend.compile(max_graphs=2)(step)
    for fold in range(4):
        torch.manual_seed(fold)
        model = DropNorm()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        compiled(model, opt, torch.randn(8, 8))
        compiled(model, opt, torch.randn(8, 8))
    assert compiled.trace_count == 4 and compiled.cache_size() <= 2
    kept = [(model, opt)]  # alive: its graph stays and counts
    for fold in range(2):
        torch.manual_seed(fold)
        model = DropNorm()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        kept.append((model, opt))
        if fold == 0:
            compiled(model, opt, torch.randn(8, 8))
    with pytest.raises(SpmdUsageError, match="would need a new graph again"):
        compiled(model, opt, torch.randn(8, 8))


class _CountingSGD(torch.optim.Optimizer):
    """A third-party style optimizer that counts its steps in a Python int."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["step"] = state.get("step", 0) + 1
                p.add_(p.grad, alpha=-group["lr"] / state["step"] ** 0.5)


def test_a_python_counter_in_optimizer_state_is_named_with_the_way_out(fake_pg, caplog):
    torch.manual_seed(0)
    model = DropNorm()
    opt = _CountingSGD(model.parameters())
    compiled = spmd_backend.compile()(step)
    with caplog.at_level(logging.WARNING, logger="spmd_backend"):
        for _ in range(3):
            compiled(model, opt, torch.randn(8, 8))
    assert retrace_messages(caplog)[-1] == (
        "spmd_backend: retracing train_step: the optimizer state of 'fc1.weight': 'step', a "
        "Python number, changed from 1 to 2. A number in optimizer state is a constant of the "
        "graph, so an optimizer that counts in Python (a custom or third-party one) retraces on "
        "every call: keep it a tensor (state['step'] = torch.tensor(0.0), incremented in place, "
        'as torch.optim does), or compile the step with torch.compile(step, backend="spmd"), '
        "which takes such a number as an input")


def test_a_transposed_batch_of_changing_size_keeps_one_symbolic_graph(fake_pg):
    """With ``dynamic_batch=True`` a (features, batch) tensor transposed has strides holding the
    batch size: the key holds its layout's structure, not the strides, so one symbolic graph
    serves every size (keyed on the strides, each size retraced until ``max_graphs``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    compiled = spmd_backend.compile(dynamic_batch=True, max_graphs=3)(step)
    gen = torch.Generator().manual_seed(1)
    for size in range(4, 14):
        x = torch.randn(8, size, generator=gen).t()
        torch.testing.assert_close(compiled(model, opt, x), step(twin, twin_opt, x))
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)
    assert compiled.trace_count <= 2
