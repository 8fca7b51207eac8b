"""commit_writes_late on tiny hand-built graphs: write-backs move after the last fallible op
only when nothing in between reads them; in-place kernels and unsafe copies stay."""

from __future__ import annotations

import torch
import torch.fx as fx

from spmd_backend.graph import ops
from spmd_backend.graph.commit import inputs_at_risk
from spmd_backend.passes import commit_writes_late

aten = torch.ops.aten


def _check(g: fx.Graph, i: int, msg: str) -> fx.Node:
    """A fallible op (an assertion on the data) standing in for a collective's wait."""
    x = next(n for n in g.nodes if n.name == "x")
    pos = g.call_function(aten.gt.Scalar, (x, -1e9))
    anyp = g.call_function(aten.all.default, (pos,))
    return g.call_function(aten._assert_async.msg, (anyp, f"{msg}{i}"))


def _module(g: fx.Graph) -> fx.GraphModule:
    g.lint()
    return fx.GraphModule(torch.nn.Module(), g)


def _interleaved() -> fx.GraphModule:
    """p0, p1 written back between two checks (as after each all_gather's wait)."""
    g = fx.Graph()
    p0, p1, x = g.placeholder("p0"), g.placeholder("p1"), g.placeholder("x")
    _check(g, 0, "check")
    g.call_function(aten.copy_.default, (p0, g.call_function(aten.mul.Tensor, (x, 2.0))))
    _check(g, 1, "check")
    g.call_function(aten.copy_.default, (p1, g.call_function(aten.add.Tensor, (x, 1.0))))
    _check(g, 2, "check")
    g.output((g.call_function(aten.sum.default, (x,)),))
    return _module(g)


def _run(gm: fx.GraphModule) -> list[torch.Tensor]:
    p0, p1, x = torch.zeros(3), torch.zeros(3), torch.arange(3.0)
    gm(p0, p1, x)
    return [p0, p1]


def test_write_backs_move_after_the_last_fallible_op_in_order():
    gm = _interleaved()
    before = _run(gm)
    assert inputs_at_risk(gm.graph).names == ("p0", "p1")
    commit_writes_late(gm)
    gm.recompile()
    gm.graph.lint()
    nodes = list(gm.graph.nodes)
    copies = [n for n in nodes if ops.is_copy_(n)]
    last_check = max(i for i, n in enumerate(nodes) if n.target is aten._assert_async.msg)
    assert [c.args[0].name for c in copies] == ["p0", "p1"]
    assert all(nodes.index(c) > last_check for c in copies)
    assert inputs_at_risk(gm.graph).names == ()  # nothing left to snapshot
    for a, b in zip(_run(gm), before):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_write_back_read_before_the_last_check_stays():
    g = fx.Graph()
    p, x = g.placeholder("p"), g.placeholder("x")
    g.call_function(aten.copy_.default, (p, g.call_function(aten.mul.Tensor, (x, 2.0))))
    view = g.call_function(aten.view.default, (p, [3]))
    read = g.call_function(aten.neg.default, (view,))  # reads the new value through a view
    _check(g, 0, "check")
    g.output((read,))
    gm = _module(g)
    commit_writes_late(gm)
    assert inputs_at_risk(gm.graph).names == ("p",)  # not moved: the reader would see the old p


def test_a_write_back_of_another_inputs_view_and_in_place_kernels_stay():
    g = fx.Graph()
    p, q, x = g.placeholder("p"), g.placeholder("q"), g.placeholder("x")
    g.call_function(aten.copy_.default, (p, g.call_function(aten.view.default, (q, [3]))))
    g.call_function(aten.add_.Tensor, (q, x))  # an in-place kernel: never moved
    _check(g, 0, "check")
    g.output((g.call_function(aten.sum.default, (x,)),))
    gm = _module(g)
    commit_writes_late(gm)
    assert inputs_at_risk(gm.graph).names == ("p", "q")


def test_no_fallible_op_is_a_no_op():
    g = fx.Graph()
    p, x = g.placeholder("p"), g.placeholder("x")
    g.call_function(aten.copy_.default, (p, x))
    g.output((x,))
    gm = _module(g)
    text = str(gm.graph)
    commit_writes_late(gm)
    assert str(gm.graph) == text
