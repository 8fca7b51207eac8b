"""dynamo/graphs.py surgery on tiny hand-built aten graphs: the gradient copies of Dynamo's
``.grad`` stand-in are folded only where every reader only reads them."""

from __future__ import annotations

import torch
import torch.fx as fx

from spmd_backend.dynamo.graphs import fold_gradient_copies
from spmd_backend.tracing.markers import GRAD_READY

aten = torch.ops.aten


def _graph(reader: object, as_output: bool = False) -> fx.Graph:
    """p, g -> copy(empty_like(p), grad_ready(g)) -> reader(copy) [-> output]."""
    g = fx.Graph()
    p, grad = g.placeholder("p"), g.placeholder("g")
    ready = g.call_function(GRAD_READY, (grad, "w"))
    empty = g.call_function(aten.empty_like.default, (p,))
    copy = g.call_function(aten.copy.default, (empty, ready))
    read = g.call_function(reader, (copy,)) if reader is not None else copy
    g.output((read, copy) if as_output else (read,))
    val = torch.empty(4, 3)
    for n in g.nodes:
        if n.op != "output":
            n.meta["val"] = val
    return g


def _copies(g: fx.Graph) -> int:
    return sum(n.target is aten.copy.default for n in g.nodes)


def test_copy_read_only_by_the_optimizer_is_folded():
    g = _graph(aten.neg.default)
    assert fold_gradient_copies(g) == 1 and _copies(g) == 0
    (neg,) = [n for n in g.nodes if n.target is aten.neg.default]
    assert neg.args[0].target is GRAD_READY
    g.lint()


def test_copy_that_is_an_output_or_detached_in_place_is_kept():
    kept_output = _graph(aten.neg.default, as_output=True)  # a .grad that outlives the step
    assert fold_gradient_copies(kept_output) == 0 and _copies(kept_output) == 1
    kept_detach = _graph(aten.detach_.default)  # zero_grad(set_to_none=False)
    assert fold_gradient_copies(kept_detach) == 0 and _copies(kept_detach) == 1


def test_copy_changing_the_layout_is_kept():
    g = _graph(aten.neg.default)
    (copy,) = [n for n in g.nodes if n.target is aten.copy.default]
    copy.meta["val"] = torch.empty(3, 4).t()  # other strides: not the marker's tensor
    assert fold_gradient_copies(g) == 0 and _copies(g) == 1


def test_module_state_reached_through_dict_is_named_and_classified():
    """After ``model.train()`` in a step Dynamo reaches state through ``__dict__``; the FQN and
    the kind come out as for the attribute spelling."""
    from torch._dynamo.source import AttrSource, DictGetItemSource, LocalSource

    from spmd_backend.dynamo.graphs import _kind, source_fqn

    def via_dict(base, key):
        return DictGetItemSource(AttrSource(base, "__dict__"), key)

    root = LocalSource("model")
    block = DictGetItemSource(via_dict(root, "_modules"), "1")
    by_dict = DictGetItemSource(via_dict(block, "_buffers"), "running_mean")
    by_attr = DictGetItemSource(AttrSource(DictGetItemSource(AttrSource(root, "_modules"), "1"),
                                           "_buffers"), "running_mean")
    for source in (by_dict, by_attr):
        assert source_fqn(source) == "1.running_mean"
        assert _kind(torch.zeros(3), source) == "buffer"
    weight = DictGetItemSource(via_dict(block, "_parameters"), "weight")
    assert source_fqn(weight) == "1.weight"
    # an attribute of the user's own named like an item is still part of the name
    assert source_fqn(DictGetItemSource(via_dict(root, "stats"), "mean")) == "stats.mean"
    assert _kind(torch.zeros(3), DictGetItemSource(via_dict(root, "stats"), "mean")) == "arg"
