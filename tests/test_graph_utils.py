"""graph_utils and op predicates on tiny hand-built graphs."""

from __future__ import annotations

import os
import stat

import pytest
import torch
import torch.fx as fx

from spmd_backend.errors import SpmdUsageError
from spmd_backend.graph import ops
from spmd_backend.graph_utils import (
    clone_subgraph,
    dump_graphs_to_files,
    find_node,
    get_output,
    is_leaf_subgraph,
)

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def small() -> fx.GraphModule:
    g = fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(aten.relu.default, (x,))
    b = g.call_function(aten.mul.Tensor, (a, 2.0))
    c = g.call_function(aten.add.Tensor, (b, 1.0))
    d = g.call_function(aten.relu.default, (c,))
    g.output([d])
    return fx.GraphModule(torch.nn.Module(), g)


def test_find_node_and_get_output():
    gm = small()
    relus = find_node(gm.graph, lambda n: n.target is aten.relu.default)
    assert [n.name for n in relus] == ["relu_default", "relu_default_1"]
    assert find_node(gm.graph, lambda n: n.target is aten.relu.default, reverse_order=True) == relus[::-1]
    assert get_output(gm.graph).op == "output"


def test_is_leaf_subgraph():
    gm = small()
    nodes = list(gm.graph.nodes)
    mul, add, relu2 = nodes[2], nodes[3], nodes[4]
    assert is_leaf_subgraph(gm.graph, [mul, add, relu2])  # ends at the output
    assert not is_leaf_subgraph(gm.graph, [mul])  # add uses it from outside


def test_clone_subgraph_before_target():
    gm = small()
    nodes = list(gm.graph.nodes)
    x, relu1, mul, add = nodes[0], nodes[1], nodes[2], nodes[3]
    clones = clone_subgraph(gm.graph, [mul, add], relu1)
    assert [c.target for c in clones] == [aten.mul.Tensor, aten.add.Tensor]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    assert order[clones[1]] < order[relu1]
    assert clones[1].args[0] is clones[0], "inputs inside the subgraph are rewired to the copies"
    # an input from outside is kept (relu1 would be after the copy: remap it to x)
    gm.graph.erase_node(clones[1])
    gm.graph.erase_node(clones[0])
    clones = clone_subgraph(gm.graph, [mul, add], relu1, arg_map={relu1: x})
    assert clones[0].args[0] is x
    gm.graph.lint()


def test_dump_graphs_to_files(tmp_path):
    gm = small()
    folder = dump_graphs_to_files({"step": gm, "raw": gm.graph})
    assert os.path.isdir(folder) and sorted(os.listdir(folder)) == ["raw.graph", "step.graph"]
    assert "relu" in open(os.path.join(folder, "step.graph")).read()
    given = str(tmp_path / "dumps")
    assert dump_graphs_to_files({"a": gm}, given) == given
    assert dump_graphs_to_files({"b": gm}, given) == given  # reused
    assert sorted(os.listdir(given)) == ["a.graph", "b.graph"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_dump_to_unwritable_folder(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
    with pytest.raises(SpmdUsageError, match="cannot write graph dumps"):
        dump_graphs_to_files({"a": small()}, str(locked))


def test_dump_to_a_path_that_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(SpmdUsageError, match="cannot write graph dumps"):
        dump_graphs_to_files({"a": small()}, str(f))


def test_predicates_match_targets_not_names():
    g = fx.Graph()
    x = g.placeholder("x")
    ar = g.call_function(c10d.all_reduce.default, (x, "sum", "0"))
    w = g.call_function(c10d.wait_tensor.default, (ar,))
    impostor = g.create_node("call_function", aten.relu.default, (w,), name="all_reduce_fake")
    g.output([impostor])
    ar._rename("something_else")
    assert ops.is_all_reduce(ar) and ops.is_collective(ar)
    assert ops.is_wait(w)
    assert not ops.is_all_reduce(impostor)
    assert not ops.is_fused_optimizer(ar)
    assert ops.has_side_effect(ar) and ops.has_side_effect(w) and not ops.has_side_effect(impostor)


def test_aliasing_follows_views_and_collectives_read_until_their_wait():
    import operator

    from spmd_backend.graph.aliasing import alias_root, read_end, readers, written
    from spmd_backend.graph.utils import node_order

    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    g = fx.Graph()
    x = g.placeholder("x")
    flat = g.call_function(aten.view.default, (x, [-1]))
    parts = g.call_function(aten.split_with_sizes.default, (flat, [2, 2]))
    second = g.call_function(operator.getitem, (parts, 1))
    own = g.call_function(aten.mul.Tensor, (x, 2))  # a new tensor, not an alias
    gather = g.call_function(c10d.all_gather_into_tensor.default, (second, 2, "0"))
    bump = g.call_function(aten.add_.Tensor, (own, 1))
    wait = g.call_function(c10d.wait_tensor.default, (gather,))
    g.output([wait, bump])

    assert alias_root(second) is x and alias_root(flat) is x and alias_root(own) is own
    assert set(readers(x)) == {own, gather}  # through the view and the split, views excluded
    assert written(bump) == [own] and written(gather) == []
    order = node_order(g)
    assert read_end(gather, order) == order[wait] > order[bump]
    assert read_end(own, order) == order[own]
