"""FQN/phase annotation of traced steps, checkpoint and ModTracker inside a traced step, report."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

import spmd_backend
from spmd_backend import ModTracker, checkpoint
from spmd_backend.gm_transformation import GraphModuleTransformation
from spmd_backend.graph import ops
from spmd_backend.graph.meta import Phase, get_fqn, get_phase
from spmd_backend.report import step_report
from spmd_backend.testing.models import GPT, MLP

aten = torch.ops.aten


def step_fn(model, optim, batch):
    loss = model(batch).float().pow(2).mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def lm_step(model, optim, batch):
    logits = model(batch)
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch.reshape(-1))
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def traced(model, optim, batch_fn, fn=step_fn, transformation=None, steps=2):
    step = spmd_backend.compile(gm_transformation=transformation)(fn)
    for _ in range(steps):
        step(model, optim, batch_fn())
    return step


def nodes(graph, target=None, phase=None, fqn=None):
    return [
        n for n in graph.nodes
        if (target is None or n.target is target)
        and (phase is None or get_phase(n) is phase)
        and (fqn is None or get_fqn(n) == fqn)
    ]


def test_mlp_forward_backward_comm_optimizer(fake_pg):
    torch.manual_seed(0)
    model = MLP(8, 16, 3, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)
    graph = traced(model, opt, lambda: torch.randn(4, 8)).graph.traced.gm.graph
    for i in range(3):
        (fwd,) = nodes(graph, aten.addmm.default, Phase.FORWARD, f"layers.{i}")
        assert fwd is not None
        # the backward matmul producing layer i's weight gradient belongs to layer i
        assert nodes(graph, aten.mm.default, Phase.BACKWARD, f"layers.{i}")
    for ar in nodes(graph, c10d_all_reduce()):
        assert get_phase(ar) is Phase.COMM and get_fqn(ar).startswith("layers.")
    # relu between layers belongs to the parent (the MLP itself, the root "")
    assert nodes(graph, aten.relu.default, Phase.FORWARD, "")
    # the optimizer's per-parameter nodes carry the parameter's FQN
    opt_fqns = {get_fqn(n) for n in graph.nodes if get_phase(n) is Phase.OPTIMIZER}
    assert {"layers.0.weight", "layers.2.bias"} <= opt_fqns
    assert all(get_phase(n) is not None for n in graph.nodes)


def c10d_all_reduce():
    return torch.ops._c10d_functional.all_reduce.default


def test_checkpointed_block_recompute_in_backward(fake_pg):
    torch.manual_seed(0)
    model = GPT(vocab=32, dim=16, heads=2, layers=2, seq=8)
    checkpoint(model.blocks[1].mlp)  # Linear-GELU-Linear: GELU's backward needs the addmm output
    checkpoint(model.blocks[0])
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, fused=True)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 32, (2, 8), generator=gen) for _ in range(3)]
    step = spmd_backend.compile()(lm_step)
    for b in batches:
        step(model, opt, b)
        lm_step(ref, ref_opt, b)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)
    graph = step.graph.traced.gm.graph
    # the recompute addmm inside the checkpointed block: phase recompute, owned by the
    # innermost module (the block's first Linear)
    (recompute_addmm,) = nodes(graph, aten.addmm.default, Phase.RECOMPUTE, "blocks.1.mlp.0")
    order = {n: i for i, n in enumerate(graph.nodes)}
    first_bwd = min(order[n] for n in nodes(graph, phase=Phase.BACKWARD))
    assert order[recompute_addmm] > first_bwd
    # a whole checkpointed block is recomputed under its own submodules' FQNs
    block0 = {get_fqn(n) for n in nodes(graph, phase=Phase.RECOMPUTE)}
    assert any(f.startswith("blocks.0.attn") for f in block0)
    # the forward of the checkpointed block is still there, as forward
    assert nodes(graph, aten.addmm.default, Phase.FORWARD, "blocks.1.mlp.0")
    assert all(get_fqn(n).startswith(("blocks.1.mlp", "blocks.0")) for n in nodes(graph, phase=Phase.RECOMPUTE))


class Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(8, 8)
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        return self.out(torch.relu(self.block(torch.relu(self.block(x)))))


def test_module_used_twice(fake_pg):
    model = Shared()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    graph = traced(model, opt, lambda: torch.randn(4, 8)).graph.traced.gm.graph
    assert len(nodes(graph, aten.addmm.default, Phase.FORWARD, "block")) == 2
    # both uses' weight-gradient matmuls belong to the block; its gradient is reduced once
    assert len(nodes(graph, aten.mm.default, Phase.BACKWARD, "block")) >= 2
    assert sum(1 for n in graph.nodes if ops.is_all_reduce(n) and get_fqn(n) == "block") == 2


def test_annotations_survive_the_passes(fake_pg):
    torch.manual_seed(0)
    model = MLP(8, 16, 3, 4)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, foreach=True)
    step = traced(model, opt, lambda: torch.randn(4, 8),
                  transformation=GraphModuleTransformation(enable_graph_optimization=True), steps=3)
    graph = step.compiled.graph
    assert all(get_phase(n) is not None for n in graph.nodes)
    assert nodes(graph, aten.cat.default, Phase.COMM)
    assert nodes(graph, aten.addmm.default, Phase.FORWARD, "layers.1")


def test_mod_tracker_inside_a_traced_step(fake_pg):
    torch.manual_seed(0)
    model = MLP(8, 16, 2, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    tracker = ModTracker()
    tracker.register_user_hooks(
        lambda m, i: seen.append(("pre_fw", tracker.get_known_fqn(m), tracker.is_bw)),
        lambda m, i, o: seen.append(("post_fw", tracker.get_known_fqn(m), tracker.is_bw)),
        lambda m, g: seen.append(("pre_bw", tracker.get_known_fqn(m), tracker.is_bw)),
        lambda m, g: seen.append(("post_bw", tracker.get_known_fqn(m), tracker.is_bw)),
    )

    def tracked_step(model, optim, batch):
        with tracker:
            loss = model(batch).sum()
            loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    step = spmd_backend.compile()(tracked_step)
    step(model, opt, torch.randn(4, 8))
    assert seen[:2] == [("pre_fw", "MLP", False), ("pre_fw", "MLP.layers.0", False)]
    assert ("pre_bw", "MLP.layers.1", True) in seen
    assert seen[-1] == ("post_bw", "MLP", True)
    seen.clear()
    step(model, opt, torch.randn(4, 8))  # runs the cached graph: no Python hooks
    assert seen == []


def test_report_groups_by_module_and_phase(fake_pg):
    torch.manual_seed(0)
    model = MLP(8, 16, 3, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = traced(model, opt, lambda: torch.randn(4, 8))
    report = step_report(step.graph.traced.gm)
    phases = report.by_phase()
    assert phases["comm"].comm_bytes == sum(p.numel() * 4 for p in model.parameters())
    fwd = {r.fqn: r for r in report.rows if r.phase == "forward"}
    # addmm(4x8 @ 8x16): 2 * 4 * 8 * 16 flops
    assert fwd["layers.0"].flops == 2 * 4 * 8 * 16
    text = str(report)
    assert "layers.0" in text and "comm" in text and "total" in text
