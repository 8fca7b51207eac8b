"""spmd_backend/dynamo/per_graph.py and the incoming-gradient audit, on one process.

An AOT function with no-op compilers stands in for a per-graph forward of ``backend="spmd"``;
:func:`~spmd_backend.dynamo.per_graph.watching_each_call` wraps it as the backend does (no
process group: the cross-rank check is covered on 2 ranks in tests/test_reliability.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from spmd_backend import SpmdUsageError
from spmd_backend.dynamo import audit, per_graph


def _watched_backend(gm, example_inputs):
    """Compile ``gm`` with AOTAutograd (no lowering) and watch each call as per-graph mode does:
    every parameter input's gradient counts as reduced."""
    compiled = aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g.forward),
                            bw_compiler=lambda g, _: make_boxed_func(g.forward))(gm, example_inputs)
    params = {i: a for i, a in enumerate(example_inputs) if isinstance(a, nn.Parameter)}
    facts = per_graph.BackwardFacts(reduced=list(params))
    return per_graph.watching_each_call(
        compiled, params, {i: f"param{i}" for i in params}, facts, "digest", None, "test graph")


def _incoming(p: torch.Tensor) -> audit._IncomingAudit:
    return next(h for h in p._backward_hooks.values() if isinstance(h, audit._IncomingAudit))


def test_gradients_with_respect_to_inputs_record_nothing():
    """``torch.autograd.grad(out, x)`` (an adversarial perturbation, a saliency map) runs the
    backward graph but accumulates no parameter gradient: recording its contributions kept a
    full gradient alive per call, and counting them as pending let a later eager gradient pass."""
    torch._dynamo.reset()
    lin = nn.Linear(4, 4)
    f = torch.compile(lambda x: torch.tanh(lin(x)), backend=_watched_backend)
    x = torch.randn(2, 4, requires_grad=True)
    for _ in range(3):
        torch.autograd.grad(f(x).sum(), x)
    assert _incoming(lin.weight).reduced == []
    assert audit._audit_of(lin.weight).pending == 0
    f(x).sum().backward()  # a real backward still accumulates, reduced
    assert lin.weight.grad is not None and audit._audit_of(lin.weight).pending == 0


def test_gradients_with_respect_to_parameters_return_without_recording():
    """``torch.autograd.grad(loss, model.parameters())`` (a gradient penalty) captures the
    parameters' gradients instead of accumulating them; asking torch whether a leaf's
    accumulator runs then raises ("a leaf node was passed to _will_engine_execute_node"), which
    crashed the step until 2026-11-27."""
    torch._dynamo.reset()
    lin = nn.Linear(4, 4)
    f = torch.compile(lambda x: torch.tanh(lin(x)), backend=_watched_backend)
    grads = torch.autograd.grad(f(torch.randn(2, 4)).sum(), list(lin.parameters()))
    assert all(g is not None for g in grads)
    assert _incoming(lin.weight).reduced == [] and audit._audit_of(lin.weight).pending == 0


def test_several_compiled_contributions_are_accepted_even_when_not_finite():
    """A weight used by two calls gets the sum of two reduced contributions; an overflow (a
    GradScaler step that will be skipped) makes them NaN, which must not read as an eager
    contribution."""
    torch._dynamo.reset()
    lin = nn.Linear(4, 4)
    f = torch.compile(lambda x: torch.tanh(lin(x)), backend=_watched_backend)
    for value in (1.0, float("nan")):
        lin.weight.grad = None
        f(f(torch.full((2, 4), value))).sum().backward()
        assert lin.weight.grad is not None


def test_an_eager_contribution_beside_a_compiled_one_raises():
    torch._dynamo.reset()
    lin = nn.Linear(4, 4)
    f = torch.compile(lambda x: torch.tanh(lin(x)), backend=_watched_backend)
    out = f(torch.randn(2, 4)) @ lin.weight  # the eager matmul also needs lin.weight's gradient
    with pytest.raises(SpmdUsageError, match="'param0' comes partly from a compiled graph"):
        out.sum().backward()


def test_a_view_of_an_input_does_not_hand_over_the_previous_calls_node():
    """Chained calls of one graph (same-shaped blocks): an output that is a view of the input
    leads, one node back, to the previous call's backward node, of the same class. It was taken
    for this call's node, leaving this call's own node unhooked."""
    torch._dynamo.reset()
    lin = nn.Linear(4, 4)
    f = torch.compile(lambda x: (x.view(-1), torch.tanh(lin(x))), backend=_watched_backend)
    _, h = f(torch.randn(2, 4))
    view, out = f(h)
    assert getattr(out.grad_fn, per_graph._SEEN, False)
    (out.sum() + view.sum()).backward()
    assert audit._audit_of(lin.weight).pending == 0
