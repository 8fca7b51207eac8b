"""IterGraphModule: moving work into the next iteration, on a hand-built graph and a real step."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.fx as fx

from spmd_backend.errors import SpmdPassError
from spmd_backend.graph.utils import find_all_descendants, find_node, get_output
from spmd_backend.iter_graph_module import IterGraphModule

aten = torch.ops.aten


def toy_step_graph() -> fx.GraphModule:
    """w, b: parameters updated in place; x: batch; lr: learning rate.

    forward:   fw = sum(x * w)            fb = sum(x * b)           out = fw + fb
    "grads":   gw = x * 2                 gb = x * 3 + w            (gb reads w too)
    update:    copy_(w, w - lr * gw)      copy_(b, b - lr * gb)
    """
    g = fx.Graph()

    def op(name, target, *args):
        return g.create_node("call_function", target, args, name=name)

    w, b, x, lr = (g.placeholder(n) for n in ("w", "b", "x", "lr"))
    xw = op("xw", aten.mul.Tensor, x, w)
    fw = op("fw", aten.sum.default, xw)
    xb = op("xb", aten.mul.Tensor, x, b)
    fb = op("fb", aten.sum.default, xb)
    out = op("out", aten.add.Tensor, fw, fb)
    gw = op("gw", aten.mul.Tensor, x, 2.0)
    x3 = op("x3", aten.mul.Tensor, x, 3.0)
    gb = op("gb", aten.add.Tensor, x3, w)
    sw = op("sw", aten.mul.Tensor, gw, lr)
    nw = op("nw", aten.sub.Tensor, w, sw)
    op("copy_w", aten.copy_.default, w, nw)
    sb = op("sb", aten.mul.Tensor, gb, lr)
    nb = op("nb", aten.sub.Tensor, b, sb)
    op("copy_b", aten.copy_.default, b, nb)
    g.output([out])
    return fx.GraphModule(torch.nn.Module(), g)


def named(gm, name):
    return find_node(gm.graph, lambda n: n.name == name)[0]


def b_update(gm):
    """The optimizer update of b (its "gradient" gb stays in the iteration that computes it)."""
    return find_all_descendants(gm.graph, [named(gm, "sb")])


def run(module, steps, *, last=True, flush_at=None, lrs=None):
    torch.manual_seed(0)
    w, b = torch.randn(4), torch.randn(4)
    outs = []
    for i in range(steps):
        x = torch.randn(4)
        lr = torch.tensor(0.1 if lrs is None else lrs[i])
        kwargs = {"last_iter": True} if (last and i == steps - 1 and isinstance(module, IterGraphModule)) else {}
        outs.append(module(w, b, x, lr, **kwargs)[0])
        if flush_at == i:
            module.flush()
    return w, b, outs


def test_move_matches_unmoved_run_with_changing_lr():
    ref_w, ref_b, ref_out = run(toy_step_graph(), 6, lrs=[0.1, 0.2, 0.05, 0.3, 0.1, 0.2])
    igm = IterGraphModule(toy_step_graph())
    igm.graph.move_to_next_iter_before(b_update(igm), named(igm, "xb"))  # x * b
    igm.finalize_setup()
    w, b, out = run(igm, 6, lrs=[0.1, 0.2, 0.05, 0.3, 0.1, 0.2])
    torch.testing.assert_close(w, ref_w)
    torch.testing.assert_close(b, ref_b)
    torch.testing.assert_close(out, ref_out)
    assert igm.pending_moves == 0 and igm.cycles == 1


def test_pending_work_and_flush_mid_run():
    ref_w, ref_b, _ = run(toy_step_graph(), 3)
    igm = IterGraphModule(toy_step_graph())
    igm.graph.move_to_next_iter_before(b_update(igm), named(igm, "xb"))
    igm.finalize_setup()
    torch.manual_seed(0)
    w, b = torch.randn(4), torch.randn(4)
    for _ in range(3):
        igm(w, b, torch.randn(4), torch.tensor(0.1))
    assert igm.pending_moves == 1
    assert not torch.allclose(b, ref_b), "b's last update is still pending"
    igm.flush()
    assert igm.pending_moves == 0
    torch.testing.assert_close(w, ref_w)
    torch.testing.assert_close(b, ref_b)
    # training continues correctly after a flush (a new cycle starts with the setup graph)
    ref_w2, ref_b2, _ = run(toy_step_graph(), 5)
    igm2 = IterGraphModule(toy_step_graph())
    igm2.graph.move_to_next_iter_before(b_update(igm2), named(igm2, "xb"))
    w2, b2, _ = run(igm2, 5, flush_at=2)
    torch.testing.assert_close(w2, ref_w2)
    torch.testing.assert_close(b2, ref_b2)


def test_second_cycle_after_cleanup_starts_clean_and_single_step_cycle():
    ref_w, ref_b, _ = run(toy_step_graph(), 4)
    igm = IterGraphModule(toy_step_graph())
    igm.graph.move_to_next_iter_before(b_update(igm), named(igm, "xb"))
    torch.manual_seed(0)
    w, b = torch.randn(4), torch.randn(4)
    # cycle 1: two steps, the second with last_iter; cycle 2: one step alone (last_iter); then one
    for i, last in enumerate([False, True, True, False]):
        igm(w, b, torch.randn(4), torch.tensor(0.1), last_iter=last)
        if i == 2:
            assert igm.pending_moves == 0
    igm.flush()
    torch.testing.assert_close(w, ref_w)
    torch.testing.assert_close(b, ref_b)
    assert igm.cycles == 3


def test_used_before_finalize_finalizes_itself(caplog):
    igm = IterGraphModule(toy_step_graph())
    with caplog.at_level(logging.INFO, logger="spmd_backend.iter_graph_module"):
        igm(torch.randn(4), torch.randn(4), torch.randn(4), torch.tensor(0.1))
    assert igm.finalized
    assert any("before finalize_setup" in r.getMessage() for r in caplog.records)


def test_derived_graphs_follow_every_edit():
    igm = IterGraphModule(toy_step_graph())
    block = b_update(igm)
    igm.graph.move_to_next_iter_before(block, named(igm, "xb"))
    # insert a node through gm.graph and replace uses: all three graphs see it
    fb = named(igm, "fb")
    with igm.graph.inserting_after(fb):
        neg = igm.graph.call_function(aten.neg.default, (fb,))
    fb.replace_all_uses_with(neg, delete_user_cb=lambda u: u is not neg)
    for g in (igm.setup_gm, igm.main_gm, igm.cleanup_gm):
        assert any(n.target is aten.neg.default for n in g.graph.nodes)
    # the moved block sits before the target in main and cleanup, nowhere in setup
    def block_positions(gm):
        names = [n.name for n in gm.graph.nodes]
        return [i for i, n in enumerate(names) if n.startswith("copy_b")], names.index("xb")

    setup_copies, _ = block_positions(igm.setup_gm)
    assert setup_copies == []
    main_copies, main_target = block_positions(igm.main_gm)
    assert len(main_copies) == 1 and main_copies[0] < main_target
    cleanup_copies, cleanup_target = block_positions(igm.cleanup_gm)
    assert len(cleanup_copies) == 2 and cleanup_copies[0] < cleanup_target < cleanup_copies[1]
    # erase a node: gone everywhere
    with igm.graph.inserting_before(get_output(igm.graph)):
        dead = igm.graph.call_function(aten.zeros.default, ([1],))
    assert all(any(n.name == dead.name for n in g.graph.nodes) for g in (igm.setup_gm, igm.main_gm))
    igm.graph.erase_node(dead)
    assert all(not any(n.name == dead.name for n in g.graph.nodes) for g in (igm.setup_gm, igm.main_gm, igm.cleanup_gm))


def test_unsafe_destination_is_refused():
    igm = IterGraphModule(toy_step_graph())
    # b is first used by x * b (mul_1); sum_2 comes after it: iteration i+1 would read old b
    with pytest.raises(
        SpmdPassError, match="unsafe destination fb: b, which the moved nodes update, is used by xb before"
    ):
        igm.graph.move_to_next_iter_before(b_update(igm), named(igm, "fb"))
    # a block that also computes gb reads w, which the unmoved update of w writes: in the next
    # iteration it would read the updated w
    with_grad = find_all_descendants(igm.graph, [named(igm, "x3")])
    with pytest.raises(SpmdPassError, match="w, which the moved nodes read, is used by xw before"):
        igm.graph.move_to_next_iter_before(with_grad, named(igm, "xb"))
    assert igm.num_moves == 0


def test_move_refuses_non_leaf_and_outputs():
    igm = IterGraphModule(toy_step_graph())
    with pytest.raises(SpmdPassError, match="not a leaf subgraph"):
        igm.graph.move_to_next_iter_before([named(igm, "sb")], named(igm, "xb"))
    with pytest.raises(SpmdPassError, match="feeds the graph's outputs"):
        igm.graph.move_to_next_iter_before([named(igm, "out")], named(igm, "xb"))
    with pytest.raises(SpmdPassError, match="target .* among the moved"):
        block = b_update(igm)
        igm.graph.move_to_next_iter_before(block, block[0])


def test_construction_is_cheap_and_finalize_linear():
    """IterGraphModule adopts the graph (no copy); finalize derives graphs in one pass each."""
    gm = toy_step_graph()
    graph = gm.graph
    igm = IterGraphModule(gm)
    assert igm.graph is graph
    igm.finalize_setup()
    assert len(igm.main_gm.graph.nodes) == len(graph.nodes) + 0


def test_lowering_is_injected_and_applied_to_the_step_graphs_only():
    lowered = []

    def lower(gm):
        lowered.append([n.name for n in gm.graph.nodes if n.op == "placeholder"])
        return gm  # called exactly like the graph: a valid lowering

    ref_w, ref_b, _ = run(toy_step_graph(), 3)
    igm = IterGraphModule(toy_step_graph(), lower=lower)
    igm.graph.move_to_next_iter_before(b_update(igm), named(igm, "xb"))
    igm.finalize_setup()
    assert len(lowered) == 2, "the graphs of the first two calls are lowered when finalized"
    assert [any(p.startswith("carry") for p in ph) for ph in lowered] == [False, True]
    w, b, _ = run(igm, 3, last=False)
    igm.flush()  # the flush graph runs unlowered
    assert len(lowered) == 2
    torch.testing.assert_close(w, ref_w)
    torch.testing.assert_close(b, ref_b)
    run(igm, 3, last=True)  # cleanup, lowered when first used
    assert len(lowered) == 3 and any(p.startswith("carry") for p in lowered[-1])


def test_a_graph_without_moves_is_lowered_once_for_every_kind_of_call():
    lowered = []

    def lower(gm):
        lowered.append(gm)
        return gm

    ref_w, ref_b, ref_out = run(toy_step_graph(), 4)
    igm = IterGraphModule(toy_step_graph(), lower=lower)
    igm.finalize_setup()
    w, b, out = run(igm, 4, last=True)  # setup, main, main, cleanup
    run(igm, 1, last=True)  # plain
    assert len(lowered) == 1
    assert list(igm.iter_graphs()) == ["main"]  # a pass would edit the one graph once
    torch.testing.assert_close(w, ref_w)
    torch.testing.assert_close(b, ref_b)
    torch.testing.assert_close(out, ref_out)


def test_enable_inductor_is_the_upstream_spelling_of_lower():
    from spmd_backend.errors import SpmdUsageError
    from spmd_backend.lowering import lower_to_inductor

    assert IterGraphModule(toy_step_graph(), enable_inductor=True).lower is lower_to_inductor
    assert IterGraphModule(toy_step_graph()).lower is None
    with pytest.raises(SpmdUsageError, match="not both"):
        IterGraphModule(toy_step_graph(), enable_inductor=True, lower=lower_to_inductor)


def test_the_graph_container_does_not_import_the_lowering():
    import ast
    import pathlib

    import spmd_backend.graph.iter_graph as iter_graph
    import spmd_backend.iter_graph_module as igm_module

    for module in (igm_module, iter_graph):
        tree = ast.parse(pathlib.Path(module.__file__).read_text())
        top_level = [
            n.module for n in tree.body if isinstance(n, ast.ImportFrom) and n.module
        ]
        assert not [m for m in top_level if m.startswith("spmd_backend.lowering")], module.__name__


def test_loading_state_while_work_is_held_is_refused_with_nothing_loaded():
    """A rollback to a checkpoint with a moved update pending: the next call would apply that
    update (computed before the load) on top of the loaded state (8.7e-3 off DDP after one step,
    found by a bug hunt on 2 ranks, 2026-11-28). It is refused until the step is flushed."""
    import pytest

    from spmd_backend import SpmdUsageError, pending_work

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    saved_model, saved_opt = model.state_dict(), opt.state_dict()
    with torch.no_grad():
        model.weight.add_(1.0)
    flushed = []

    def flush(why: str) -> None:
        flushed.append(why)

    pending_work.hold([model, opt], flush, "train_step")
    before = model.weight.detach().clone()
    with pytest.raises(SpmdUsageError, match="flush"):
        model.load_state_dict(saved_model)
    with pytest.raises(SpmdUsageError, match="flush"):
        opt.load_state_dict(saved_opt)
    assert torch.equal(model.weight, before) and not flushed
    pending_work.release([model, opt], flush)
    model.load_state_dict(saved_model)
    opt.load_state_dict(saved_opt)
    assert torch.equal(model.weight, saved_model["weight"])
