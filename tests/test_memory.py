"""spmd_backend.memory: the heap freed by tracing and compiling is handed back to the OS once per
compile (the resident-memory effect is measured by tools/bench.py --memory, not here)."""

from __future__ import annotations

import torch

import spmd_backend
import spmd_backend.api as api
from spmd_backend.memory import release_freed_heap
from spmd_backend.testing import fake_process_group
from spmd_backend.testing.models import MLP


def test_glibc_is_asked_on_linux():
    assert release_freed_heap() is True  # this machine runs glibc


def test_the_compile_door_releases_once_per_compiled_graph(monkeypatch):
    calls = []
    monkeypatch.setattr(api, "release_freed_heap", lambda: calls.append(1) or True)

    def step(model, optim, x):
        model(x).sum().backward()
        optim.step()
        optim.zero_grad()

    with fake_process_group(world_size=2):
        model = MLP(8, 16, 2, 2)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        compiled = spmd_backend.compile()(step)
        for _ in range(3):
            compiled(model, optim, torch.randn(4, 8))
        assert compiled.trace_count == 1 and len(calls) == 1
        compiled(model, optim, torch.randn(6, 8))  # a new shape: a second graph
        assert compiled.trace_count == 2 and len(calls) == 2
