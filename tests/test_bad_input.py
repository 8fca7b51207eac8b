"""Bad input: a clear error naming the problem, and the user's model and optimizer untouched."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import spmd_backend
from spmd_backend import SpmdDistributedError, SpmdTraceError, SpmdUsageError
from spmd_backend.testing.models import MLP
from spmd_backend.testing.steps import train_step


def snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {
        "params": [(id(p), p.detach().clone(), p.grad) for p in model.parameters()],
        "buffers": [b.clone() for b in model.buffers()],
        "modules": [(n, id(m)) for n, m in model.named_modules()],
        "groups": [(id(g["params"]), [id(p) for p in g["params"]], dict(g)) for g in opt.param_groups],
        "state_obj": id(opt.state),
        "state": {id(k): dict(v) for k, v in opt.state.items()},
        "hooks": [
            (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))
            for m in model.modules()
        ],
        "step_hooks": (len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks)),
        "compiling": torch.compiler.is_compiling(),
    }


def assert_untouched(before: dict, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    after = snapshot(model, opt)
    for (i1, v1, g1), (i2, v2, g2) in zip(before["params"], after["params"]):
        assert i1 == i2 and torch.equal(v1, v2) and g1 is g2
    for b1, b2 in zip(before["buffers"], after["buffers"]):
        assert torch.equal(b1, b2)
    for key in ("modules", "state_obj", "hooks", "step_hooks", "compiling"):
        assert before[key] == after[key], key
    for (l1, ids1, g1), (l2, ids2, g2) in zip(before["groups"], after["groups"]):
        assert l1 == l2 and ids1 == ids2
        assert {k: v for k, v in g1.items() if k != "params"} == {
            k: v for k, v in g2.items() if k != "params"
        }
    assert before["state"].keys() == after["state"].keys()


def make():
    torch.manual_seed(0)
    model = MLP(8, 16, 2, 4)
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def good_step(model, optim, batch):
    model(batch).sum().backward()
    optim.step()
    optim.zero_grad()


def test_no_module(fake_pg):
    model, opt = make()

    @spmd_backend.compile()
    def step(optim, batch):
        optim.step()

    with pytest.raises(SpmdUsageError, match="no torch.nn.Module"):
        step(opt, torch.randn(2, 8))


def test_two_modules(fake_pg):
    model, opt = make()
    other = MLP(8, 16, 2, 4)
    before = snapshot(model, opt)

    @spmd_backend.compile()
    def step(model, other, optim, batch):
        (model(batch) + other(batch)).sum().backward()
        optim.step()

    with pytest.raises(SpmdUsageError, match="2 modules .*MLP, MLP.*exactly one"):
        step(model, other, opt, torch.randn(2, 8))
    assert_untouched(before, model, opt)


def test_two_optimizers(fake_pg):
    model, opt = make()
    opt2 = torch.optim.SGD(model.parameters(), lr=0.1)

    @spmd_backend.compile()
    def step(model, o1, o2, batch):
        model(batch).sum().backward()
        o1.step()
        o2.step()

    with pytest.raises(SpmdUsageError, match="2 optimizers"):
        step(model, opt, opt2, torch.randn(2, 8))


def test_optimizer_with_foreign_parameter(fake_pg):
    model, _ = make()
    stranger = nn.Parameter(torch.randn(3, 5))
    opt = torch.optim.SGD([*model.parameters(), stranger], lr=0.1)
    before = snapshot(model, opt)
    with pytest.raises(SpmdUsageError, match=r"param_groups\[0\]\['params'\]\[4\] \(shape \[3, 5\]\) is not a parameter"):
        spmd_backend.compile()(good_step)(model, opt, torch.randn(2, 8))
    assert_untouched(before, model, opt)


def test_backward_never_called(fake_pg):
    model, opt = make()
    before = snapshot(model, opt)

    @spmd_backend.compile()
    def step(model, optim, batch):
        loss = model(batch).sum()
        optim.step()
        return loss

    with pytest.raises(SpmdUsageError, match="no parameter gradient: loss.backward\\(\\) was never called"):
        step(model, opt, torch.randn(2, 8))
    assert_untouched(before, model, opt)


def test_unsupported_return_value(fake_pg):
    model, opt = make()
    before = snapshot(model, opt)

    class Result:
        pass

    @spmd_backend.compile()
    def step(model, optim, batch):
        model(batch).sum().backward()
        optim.step()
        return {"stats": [Result()]}

    with pytest.raises(SpmdUsageError, match=r"type .*Result at output\['stats'\]\[0\]"):
        step(model, opt, torch.randn(2, 8))
    assert_untouched(before, model, opt)


@pytest.mark.parametrize("inductor", [False, True])
def test_returning_item_gives_the_number_of_every_call(fake_pg, inductor):
    """``return loss.item()`` (the usual logging idiom): the graph returns the tensor and the
    step returns its number, the current call's (not the traced one's)."""
    from spmd_backend.gm_transformation import GraphModuleTransformation

    model, opt = make()
    twin, twin_opt = make()

    def step(model, optim, batch):
        loss = model(batch).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        return {"loss": loss.item(), "n": batch.shape[0]}

    compiled = spmd_backend.compile(
        gm_transformation=GraphModuleTransformation(enable_graph_optimization=True, enable_inductor=True)
        if inductor else None)(step)
    for i in range(3):
        batch = torch.randn(2, 8, generator=torch.Generator().manual_seed(i))
        out, ref = compiled(model, opt, batch), step(twin, twin_opt, batch)
        assert type(out["loss"]) is float and out["n"] == 2
        assert out["loss"] == pytest.approx(ref["loss"], rel=1e-5), (i, out, ref)


def test_arithmetic_on_item_is_refused_naming_it(fake_pg):
    model, opt = make()
    before = snapshot(model, opt)

    @spmd_backend.compile()
    def step(model, optim, batch):
        loss = model(batch).pow(2).mean()
        loss.backward()
        optim.step()
        return {"scaled": loss.item() * 2}

    with pytest.raises(SpmdUsageError, match=r"computed from a tensor's value at output\['scaled'\]"):
        step(model, opt, torch.randn(2, 8))
    assert_untouched(before, model, opt)


def test_formatting_item_in_the_step_is_refused_saying_why(fake_pg):
    model, opt = make()
    before = snapshot(model, opt)

    @spmd_backend.compile()
    def step(model, optim, batch):
        loss = model(batch).pow(2).mean()
        loss.backward()
        print(f"loss {loss.item():.4f}")  # rank-0 logging inside the step, as DDP loops do
        optim.step()
        return loss.detach()

    with pytest.raises(SpmdTraceError) as info:
        step(model, opt, torch.randn(2, 8))
    message = str(info.value)
    assert "uses a number read from a tensor (.item(), float(t)) as a Python value" in message
    assert 'print(f"loss {loss.item():.4f}")' in message and "Return the tensor" in message
    assert_untouched(before, model, opt)


def test_decision_inside_a_torch_module_names_its_line(fake_pg):
    """BatchNorm with momentum=None reads num_batches_tracked as a Python number on every
    step: the refusal names torch's line and the module setting, not only the step's line."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16, momentum=None), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = snapshot(model, opt)
    with pytest.raises(SpmdTraceError, match=r"torch/nn/modules/batchnorm\.py:\d+ .*num_batches_tracked"
                                             r".*momentum=None"):
        spmd_backend.compile()(good_step)(model, opt, torch.randn(4, 8))
    assert_untouched(before, model, opt)


class _PackedLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(8, 12, batch_first=True)
        self.head = nn.Linear(12, 1)

    def forward(self, x, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        _, (h, _) = self.lstm(packed)
        return self.head(h[-1])


def _packed_step(model, opt, x, lengths):
    model(x, lengths).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def test_a_packed_sequence_names_the_recurrent_layer_and_what_to_do(fake_pg):
    """An LSTM given a PackedSequence reads its batch sizes as Python numbers (a size of
    ``torch.zeros``): the trace failed with a bare TypeError about a FunctionalTensor; the
    refusal now names torch's line and says to pass the padded batch."""
    torch.manual_seed(0)
    model = _PackedLSTM()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    before = snapshot(model, opt)
    with pytest.raises(SpmdTraceError, match=r"Python decision on a tensor's value at "
                                             r"torch/nn/modules/rnn\.py:\d+ .*PackedSequence"):
        spmd_backend.compile()(_packed_step)(model, opt, torch.randn(3, 5, 8), torch.tensor([5, 2, 4]))
    assert_untouched(before, model, opt)


def _ctc_step(model, opt, x, targets, input_lengths, target_lengths):
    log_probs = model(x).log_softmax(-1)
    nn.functional.ctc_loss(log_probs, targets, input_lengths, target_lengths).backward()
    opt.step()
    opt.zero_grad()


def test_an_op_whose_output_shape_depends_on_values_is_named_as_such(fake_pg):
    """ctc_loss with tensor lengths: its output's shape comes from the lengths' values (not a
    Python decision, as the refusal used to say); the refusal names torch's line."""
    torch.manual_seed(0)
    model = nn.Linear(8, 6)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    before = snapshot(model, opt)
    with pytest.raises(SpmdTraceError, match=r"op whose output shape depends on a tensor's values "
                                             r"at torch/nn/functional\.py:\d+ .*ctc_loss"):
        spmd_backend.compile()(_ctc_step)(model, opt, torch.randn(12, 3, 8),
                                          torch.randint(1, 6, (3, 5)), torch.full((3,), 12),
                                          torch.tensor([5, 4, 3]))
    assert_untouched(before, model, opt)


def test_a_gradient_left_from_before_a_resize_is_named(fake_pg):
    """transformers' resize_token_embeddings resizes the Parameter in place and keeps its old
    .grad; the trace failed with torch's gradient-assignment error until 2026-11-28."""
    model = nn.Linear(4, 3)
    model(torch.randn(2, 4)).sum().backward()
    model.weight.data = torch.randn(5, 4)
    model.bias.data = torch.randn(5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = snapshot(model, opt)
    with pytest.raises(SpmdUsageError, match=r"gradient of weight \(parameter \[5, 4\], \.grad "
                                             r"\[3, 4\]\), bias .*model\.zero_grad\(set_to_none=True\)"):
        spmd_backend.compile()(train_step)(model, opt, torch.randn(2, 4))
    assert_untouched(before, model, opt)
    model.zero_grad(set_to_none=True)
    spmd_backend.compile()(train_step)(model, opt, torch.randn(2, 4))


class _Cayley(nn.Module):
    """An orthogonal map from a skew matrix by ``linalg.solve`` (peft's BOFT/OFT adapters)."""

    def __init__(self) -> None:
        super().__init__()
        self.r = nn.Parameter(torch.randn(8, 8) * 0.1)

    def forward(self, x):
        skew = 0.5 * (self.r - self.r.t())
        eye = torch.eye(8)
        return x @ torch.linalg.solve(eye + skew, eye - skew)


def test_an_op_torch_orders_by_an_effect_token_is_named(fake_pg):
    """The backward of linalg.solve checks its matrix through an effectful op; the trace failed
    with an internal placeholder count until 2026-11-28 (hunt 36)."""
    model = nn.Sequential(nn.Tanh(), _Cayley())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = snapshot(model, opt)
    # the module is named: the op may come from any torch.linalg function (cholesky too)
    with pytest.raises(SpmdTraceError, match=r"cannot trace aten\._linalg_check_errors\.default "
                                             r"\(in module '1'\): .*effect token.*cholesky.*"
                                             r"backend=\"spmd\""):
        spmd_backend.compile()(train_step)(model, opt, torch.randn(4, 8))
    assert_untouched(before, model, opt)


class _Policy(nn.Module):
    """A policy-gradient head: a categorical distribution over actions, sampled in the step."""

    def __init__(self, validate: bool | None) -> None:
        super().__init__()
        self.logits = nn.Linear(8, 4)
        self.validate = validate

    def forward(self, x):
        d = torch.distributions.Categorical(logits=self.logits(x), validate_args=self.validate)
        action = d.sample()
        return -(d.log_prob(action) * action.float()).mean() - 0.01 * d.entropy().mean()


def _policy_step(model, opt, x):
    loss = model(x)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def test_distribution_argument_validation_is_named_and_can_be_switched_off(fake_pg):
    """torch.distributions validates a distribution's parameters by default (a Python decision
    on their values); the refusal used to read as the user's own ``if`` on a tensor. It names
    the check and the switch; with the switch off the step compiles and matches eager, samples
    included."""
    torch.manual_seed(0)
    model = _Policy(validate=None)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    before = snapshot(model, opt)
    # the default is on (``__debug__``) until the process's first torch.compile, whose Dynamo
    # set-up turns it off for good (torch 2.13's TorchPatcher): as a fresh script has it
    default = torch.distributions.Distribution._validate_args
    torch.distributions.Distribution.set_default_validate_args(True)
    try:
        with pytest.raises(SpmdTraceError, match=r"torch\.distributions checks a distribution's "
                                                 r"parameters .* at torch/distributions/\S+\.py:"
                                                 r"\d+ .*validate_args=False"):
            spmd_backend.compile()(_policy_step)(model, opt, torch.randn(6, 8))
    finally:
        torch.distributions.Distribution.set_default_validate_args(default)
    assert_untouched(before, model, opt)

    model.validate = False
    eager = copy.deepcopy(model)
    eager_opt = torch.optim.Adam(eager.parameters(), lr=0.1)
    step = spmd_backend.compile()(_policy_step)
    for i in range(3):
        x = torch.randn(6, 8)
        torch.manual_seed(100 + i)
        got = step(model, opt, x)
        torch.manual_seed(100 + i)
        want = _policy_step(eager, eager_opt, x)
        torch.testing.assert_close(got, want)
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q)


class PythonCounterSGD(torch.optim.Optimizer):
    """Momentum SGD with a bias-corrected step as some third-party optimizers write it: the step
    counter is a Python int in the param group (pytorch_optimizer's Adan, Lion, Ranger ...)."""

    def __init__(self, params, lr=0.1, beta=0.9):
        super().__init__(params, {"lr": lr, "beta": beta})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            self._update(group)

    def _update(self, group):
        correction = 1 - group["beta"] ** group["step"]
        for p in group["params"]:
            if p.grad is None:
                continue
            buf = self.state[p].setdefault("buf", torch.zeros_like(p))
            buf.mul_(group["beta"]).add_(p.grad, alpha=1 - group["beta"])
            p.sub_(buf * (group["lr"] / correction))


def test_python_counter_in_a_param_group_is_refused(fake_pg):
    """The traced step's ``group['step'] += 1`` went to the trace only: every replay reused the
    bias correction of the traced step and the group never advanced (0.06 off eager after 8
    steps with pytorch_optimizer's Adan). Now refused naming the entry, with nothing changed."""
    torch.manual_seed(0)
    model = MLP(8, 16, 2, 4)
    opt = PythonCounterSGD(model.parameters())
    good_step(model, opt, torch.randn(2, 8))  # eager: the group holds its counter already
    before = snapshot(model, opt)
    with pytest.raises(SpmdUsageError, match=r"PythonCounterSGD.step\(\) changes "
                                             r"param_groups\[0\]\['step'\] \(1 -> 2\)"):
        spmd_backend.compile()(good_step)(model, opt, torch.randn(2, 8))
    assert_untouched(before, model, opt)
    assert opt.param_groups[0]["step"] == 1


def test_a_warmup_written_in_the_step_is_refused_saying_where_to_write_it(fake_pg):
    """A step that sets ``g["lr"]`` itself (a hand-written warmup) was refused as if the
    optimizer kept a counter in its group; the message now names the step's own write and says
    to set the group before the call, which the graph reads as an input."""
    torch.manual_seed(0)
    model = MLP(8, 16, 2, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)

    def warmup_step(model, opt, batch, it):
        for group in opt.param_groups:
            group["lr"] = 0.01 * min(1.0, (it + 1) / 4)
        return good_step(model, opt, batch)

    before = snapshot(model, opt)
    with pytest.raises(SpmdUsageError, match=r"the train step sets param_groups\[0\]\['lr'\] "
                                             r"\(0.01 -> 0.0025\) itself, outside AdamW.step\(\)"):
        spmd_backend.compile()(warmup_step)(model, opt, torch.randn(2, 8), 0)
    assert_untouched(before, model, opt)
    assert opt.param_groups[0]["lr"] == 0.01


class CountingAdam(torch.optim.Adam):
    """A subclass keeping a Python counter in its group, written after ``super().step()``:
    torch's step hooks then run nested (both ``step`` methods carry them)."""

    def step(self, closure=None):
        out = super().step(closure)
        for group in self.param_groups:
            group["k"] = group.get("k", 0) + 1
        return out


def test_a_subclass_counter_written_after_super_step_is_the_optimizers(fake_pg):
    torch.optim.Adam(nn.Linear(1, 1).parameters())  # torch hooks Adam.step on first use
    model = MLP(8, 16, 2, 4)
    opt = CountingAdam(model.parameters(), lr=0.01)
    with pytest.raises(SpmdUsageError, match=r"CountingAdam.step\(\) changes "
                                             r"param_groups\[0\]\['k'\]"):
        spmd_backend.compile()(good_step)(model, opt, torch.randn(2, 8))


class TensorCounterSGD(PythonCounterSGD):
    """The counter as a tensor in the param group, as timm's Lamb keeps it."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            if "step" not in group:
                group["step"] = torch.zeros((), dtype=torch.float32)
            group["step"] += 1
            self._update(group)


def test_tensor_counter_in_a_param_group_is_refused_naming_the_dynamo_door():
    """The compile door refuses it as it does a Python counter, and says that
    ``backend="spmd"`` (which guards on the group and carries the tensor) runs it: checked
    here against eager (one rank)."""
    from spmd_backend.testing import fake_process_group

    torch.manual_seed(0)
    model = MLP(8, 16, 2, 4)
    twin = copy.deepcopy(model)
    opt, ref = TensorCounterSGD(model.parameters()), TensorCounterSGD(twin.parameters())
    before = snapshot(model, opt)
    with fake_process_group(world_size=1):
        with pytest.raises(SpmdUsageError, match=r"\(absent -> a tensor\).*backend=\"spmd\"\), which runs it"):
            spmd_backend.compile()(good_step)(model, opt, torch.randn(2, 8))
        assert_untouched(before, model, opt)
        compiled = torch.compile(good_step, backend="spmd", options={"inductor": False})
        for _ in range(3):
            x = torch.randn(2, 8)
            compiled(model, opt, x)
            good_step(twin, ref, x)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)
    assert float(opt.param_groups[0]["step"]) == 3


class SkipZeroGradSGD(torch.optim.Optimizer):
    """A third-party-style optimizer deciding in Python on a tensor's value."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None or p.grad.abs().sum() == 0:  # the decision
                    continue
                p.add_(p.grad, alpha=-group["lr"])


def test_decision_inside_a_third_party_optimizer_names_its_line(fake_pg):
    """torch's step wrapper calls the optimizer's own step: the refusal names the optimizer's
    line (it named torch's wrapper, torch/optim/optimizer.py, before)."""
    model, _ = make()
    opt = SkipZeroGradSGD(model.parameters())
    before = snapshot(model, opt)
    with pytest.raises(SpmdTraceError, match=r"decision on a tensor's value at \S*test_bad_input"
                                             r"\.py:\d+ `if p.grad is None or p.grad.abs"):
        spmd_backend.compile()(good_step)(model, opt, torch.randn(2, 8))
    assert_untouched(before, model, opt)


def test_error_inside_the_step_restores_everything(fake_pg):
    model, opt = make()
    before = snapshot(model, opt)

    @spmd_backend.compile()
    def step(model, optim, batch):
        model(batch).sum().backward()
        optim.step()
        raise ValueError("user bug")

    with pytest.raises(SpmdTraceError, match="user bug"):
        step(model, opt, torch.randn(2, 8))
    assert_untouched(before, model, opt)


@pytest.mark.parametrize("make_scheduler", [
    lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5),
    lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s),  # transformers' kind
    lambda opt: torch.optim.lr_scheduler.SequentialLR(opt, [
        torch.optim.lr_scheduler.ConstantLR(opt, factor=0.5, total_iters=2),
        torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)], milestones=[2]),
    lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt),
], ids=["cosine", "lambda", "sequential", "plateau"])
def test_scheduler_step_inside_the_step_is_refused_untouched(fake_pg, make_scheduler):
    """A replayed graph would never step the schedule again (the step's Python runs only while
    tracing); before the refusal the trace failed inside the scheduler with a torch error and
    had already bumped its epoch."""
    model, opt = make()
    sched = make_scheduler(opt)
    sched_before = {k: v for k, v in vars(sched).items() if isinstance(v, (int, float, list))}
    before = snapshot(model, opt)

    @spmd_backend.compile()
    def step(model, optim, sched, batch):
        loss = model(batch).sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        sched.step(loss) if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau) \
            else sched.step()
        return loss

    with pytest.raises(SpmdUsageError, match=rf"calls {type(sched).__name__}\.step\(\) \(at .*"
                       r"test_bad_input.py.*Call scheduler.step\(\) after the compiled step"):
        step(model, opt, sched, torch.randn(2, 8))
    assert_untouched(before, model, opt)
    assert {k: v for k, v in vars(sched).items() if k in sched_before} == sched_before
    # the same loop with scheduler.step() after the compiled call works
    plain = spmd_backend.compile()(good_step)
    for _ in range(2):
        plain(model, opt, torch.randn(2, 8))
        sched.step(1.0) if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau) \
            else sched.step()


@pytest.mark.parametrize("given", ["none", "another"])
def test_an_optimizer_the_step_was_not_given_is_refused_untouched(fake_pg, given):
    """Reached through a closure (``make_step(opt)``) or a global, the optimizer's step traced
    as nothing: until 2026-11-28 the first call returned without stepping (0.025 off DDP) and
    the second raised about a captured tensor."""
    model, opt = make()
    other = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = snapshot(model, opt)

    def make_step(optim):
        def step(model, batch):
            model(batch).sum().backward()
            optim.step()
            optim.zero_grad()
        return step

    closure_step = make_step(opt)
    if given == "none":
        compiled, args = spmd_backend.compile()(closure_step), (model, torch.randn(2, 8))
    else:
        compiled = spmd_backend.compile()(lambda model, optim, batch: closure_step(model, batch))
        args = (model, other, torch.randn(2, 8))
    with pytest.raises(SpmdUsageError, match=r"calls Adam\.step\(\) of an optimizer it was not "
                       r"given as an argument \(at .*test_bad_input.py.*Pass the optimizer"):
        compiled(*args)
    assert_untouched(before, model, opt)
    assert not other.state


def test_an_optimizer_the_step_makes_itself_is_traced(fake_pg):
    """Not refused: made from ``model.parameters()`` inside the step, it holds the traced
    stand-ins (a meta-learning inner loop, a one-off SGD step)."""
    model, _ = make()
    twin = copy.deepcopy(model)

    def step(model, batch):
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        model(batch).sum().backward()
        inner.step()
        inner.zero_grad()

    compiled = spmd_backend.compile()(step)
    for _ in range(2):
        x = torch.randn(2, 8)
        compiled(model, x)
        step(twin, x)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)


def test_captured_real_tensor_is_named(fake_pg):
    model, opt = make()
    captured = torch.randn(4)

    @spmd_backend.compile()
    def step(model, optim, batch):
        (model(batch) * captured).sum().backward()
        optim.step()

    with pytest.raises(SpmdTraceError, match=r"neither a parameter, buffer.*one a library keeps "
                                             r".*backend=\"spmd\""):
        step(model, opt, torch.randn(2, 8))


TOTAL = torch.zeros(())


def test_a_write_into_a_captured_real_tensor_is_named(fake_pg):
    """A running total kept in a global tensor: torch's functionalization assertion ("please
    report a bug to PyTorch") before 2026-11-28; now named, with nothing changed."""
    model, opt = make()
    before = [p.detach().clone() for p in model.parameters()]

    @spmd_backend.compile()
    def step(model, optim, batch):
        loss = model(batch).sum()
        loss.backward()
        optim.step()
        TOTAL.add_(loss.detach())

    with pytest.raises(SpmdTraceError, match=r"wrote into a real tensor .*Register it as a "
                                             r"buffer.*TOTAL\.add_"):
        step(model, opt, torch.randn(2, 8))
    assert TOTAL.item() == 0 and not opt.state
    assert all(torch.equal(p, q) and p.grad is None for p, q in zip(model.parameters(), before))


def test_argument_whose_gradient_the_step_would_drop_is_refused(fake_pg):
    """Features computed outside the step by another module (or a leaf input that requires
    grad): eager backward would train that module (fill the input's ``.grad``); the compiled
    step silently dropped those gradients before."""
    model, opt = make()
    encoder = nn.Linear(8, 8)
    compiled = spmd_backend.compile()(good_step)
    before = snapshot(model, opt)
    with pytest.raises(SpmdUsageError, match=r"reaches argument args\[2\], which is the output "
                                             r"of an autograd graph outside the step \(Addmm"):
        compiled(model, opt, encoder(torch.randn(2, 8)))
    with pytest.raises(SpmdUsageError, match=r"args\[2\], which requires grad: eager backward "
                                             r"would fill its .grad"):
        compiled(model, opt, torch.randn(2, 8, requires_grad=True))
    assert_untouched(before, model, opt)
    assert encoder.weight.grad is None
    compiled(model, opt, encoder(torch.randn(2, 8)).detach())  # the way out


def test_failed_trace_leaves_the_module_modes(fake_pg):
    model, opt = make()
    model.eval()

    @spmd_backend.compile()
    def step(model, optim, batch):
        model.train()
        loss = model(batch).sum()
        if loss > 0:  # a Python decision on a tensor value: refused
            loss = loss * 2
        loss.backward()
        optim.step()

    with pytest.raises(SpmdTraceError, match="Python decision on a tensor's value"):
        step(model, opt, torch.randn(2, 8))
    assert not any(m.training for m in model.modules())


def test_input_the_step_marks_requires_grad_itself_is_fine(fake_pg):
    """Adversarial examples (FGSM): the step asks for the input's gradient itself."""
    model, opt = make()

    @spmd_backend.compile()
    def fgsm_step(model, optim, x):
        x.requires_grad_(True)
        model(x).sum().backward()
        x_adv = (x + 0.1 * x.grad.sign()).detach()
        optim.zero_grad()
        model(x_adv).sum().backward()
        optim.step()
        optim.zero_grad()

    fgsm_step(model, opt, torch.randn(2, 8))


def test_last_train_step_on_a_plain_graph(fake_pg):
    model, _ = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = spmd_backend.compile()(good_step)
    step(model, opt, torch.randn(2, 8))
    with pytest.raises(SpmdUsageError, match="last_train_step=True.*IterGraphModule"):
        step(model, opt, torch.randn(2, 8), last_train_step=True)


def test_no_process_group():
    model, opt = make()
    with pytest.raises(SpmdDistributedError, match="init_process_group"):
        spmd_backend.compile()(good_step)(model, opt, torch.randn(2, 8))


def test_bad_parallel_mode_arguments():
    with pytest.raises(SpmdUsageError, match="reduce_op='max'"):
        spmd_backend.DataParallel(reduce_op="max")
    with pytest.raises(SpmdUsageError, match="expected a DataParallel"):
        spmd_backend.compile(parallel_mode="ddp")
    with pytest.raises(SpmdUsageError, match="expected Override instances"):
        spmd_backend.compile(module_override=[object()])


def test_zero_redundancy_optimizer_points_at_shard_optimizer(fake_pg):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model, _ = make()
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=0.1)
    with pytest.raises(SpmdUsageError, match=r"ZeroRedundancyOptimizer shards .*"
                                             r"DataParallel\(shard_optimizer=True\)"):
        spmd_backend.compile()(good_step)(model, opt, torch.randn(2, 8))


@pytest.mark.parametrize("door", ["compile", "dynamo"])
def test_ddp_wrapped_module_is_refused_naming_the_wrapper(fake_pg, door):
    """Migrating from DDP with the wrapper still on: backend="spmd" ran DDP's eager forward
    around the graphs, and the gradient audit blamed a graph break; spmd_backend.compile traced
    DDP's forward, whose reducer failed on the next trace. Both name the wrapper now."""
    from torch.nn.parallel import DistributedDataParallel

    torch._dynamo.reset()
    model, opt = make()
    ddp = DistributedDataParallel(model)
    before = snapshot(model, opt)
    compiled = (spmd_backend.compile()(good_step) if door == "compile" else
                torch.compile(good_step, backend="spmd", options={"inductor": False}))
    with pytest.raises(Exception, match=r"module wrapped in DistributedDataParallel \(MLP\).*"
                                        r"ddp_model.module") as info:
        compiled(ddp, opt, torch.randn(2, 8))
    # raised before Dynamo traces the frame, as a backend failure (BackendCompilerFailed)
    assert isinstance(getattr(info.value, "inner_exception", info.value), SpmdUsageError)
    assert_untouched(before, model, opt)


def _scaling_step(model, opt, x, c):
    c.mul_(0.5)  # the step writes its last argument in place
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def test_a_written_argument_sharing_memory_with_another_is_refused(fake_pg):
    """``step(model, opt, x, x)`` for a step that scales its last argument in place: eager sees
    the write through ``x``, the graph took them as separate inputs and replayed the unscaled
    ``x``, silently, until 2026-11-28 (hunt 45). Separate tensors still run."""
    model, opt = make()
    compiled = spmd_backend.compile()(_scaling_step)
    compiled(model, opt, torch.randn(2, 8), torch.ones(3))
    x = torch.randn(2, 8)
    before, kept = snapshot(model, opt), x.clone()
    with pytest.raises(SpmdUsageError, match=r"writes args\[3\] in place, and args\[2\] shares "
                                             r"its memory"):
        compiled(model, opt, x, x)
    assert_untouched(before, model, opt)
    assert torch.equal(x, kept)
