"""module_override: swap an untraceable submodule for tracing, transform the graph afterwards."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.nn as nn

import spmd_backend
from spmd_backend import Override, SpmdUsageError
from spmd_backend.graph import ops
from spmd_backend.testing.steps import train_step as step


class Gate(nn.Module):
    """Data-dependent Python control flow: make_fx under fake tensors cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > -1e9:  # always true, but data-dependent
            return torch.relu(self.fc(x))
        return x


class TraceableGate(nn.Module):
    """Takes the branch the real data always takes; shares Gate's parameters."""

    def __init__(self, orig: Gate) -> None:
        super().__init__()
        self.fc = orig.fc

    def forward(self, x):
        return torch.relu(self.fc(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.gate = Gate()
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        return self.out(self.gate(self.inp(x)))


class GateOverride(Override):
    def __init__(self) -> None:
        self.seen: list[str] = []
        self.transformed = 0
        self.state_len = -1

    def replacement(self, fqn, orig_submodule):
        if isinstance(orig_submodule, Gate):
            self.seen.append(fqn)
            return TraceableGate(orig_submodule)
        return orig_submodule

    def transform(self, gm, flat_state):
        self.transformed += 1
        self.state_len = len(flat_state)
        return gm


def test_override_swaps_for_tracing_only_and_transforms(fake_pg):
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    gate = model.gate
    override = GateOverride()
    compiled = spmd_backend.compile(module_override=[override])(step)
    for _ in range(3):
        batch = torch.randn(5, 4)
        compiled(model, opt, batch)
        step(ref, ref_opt, batch)
    assert model.gate is gate, "the user's module must be restored after tracing"
    assert override.seen == ["gate", "gate"]  # bootstrap trace + steady-state trace
    assert override.transformed == 1  # only the steady-state graph is transformed
    n_params = len(list(model.parameters()))
    assert override.state_len == 2 * n_params  # parameters + momentum buffers
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)
    assert sum(ops.is_all_reduce(n) for n in compiled.graph.traced.gm.graph.nodes) == n_params


def test_without_override_the_data_dependent_module_fails_clearly(fake_pg):
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(spmd_backend.SpmdTraceError, match="Python decision on a tensor's value") as info:
        spmd_backend.compile()(step)(model, opt, torch.randn(5, 4))
    lines, first = inspect.getsourcelines(Gate.forward)
    lineno = first + next(i for i, line in enumerate(lines) if "if x.sum() > -1e9" in line)
    assert f"test_module_override.py:{lineno} `if x.sum() > -1e9" in str(info.value)
    assert isinstance(model.gate, Gate)


class BadOverride(Override):
    def replacement(self, fqn, orig_submodule):
        if isinstance(orig_submodule, Gate):
            return nn.Linear(8, 8)  # new parameters: lifting would be wrong
        return orig_submodule


def test_replacement_with_other_parameters_is_refused(fake_pg):
    model = Net()
    gate = model.gate
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(SpmdUsageError, match="same parameters and buffers.*gate"):
        spmd_backend.compile(module_override=[BadOverride()])(step)(model, opt, torch.randn(5, 4))
    assert model.gate is gate
