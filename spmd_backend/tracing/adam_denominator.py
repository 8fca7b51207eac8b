"""Single-tensor Adam/AdamW's update in eager's form: no NaN at lr = 0.

Every traced step runs torch 2.13's *capturable* single-tensor Adam (AdamW shares it), which folds
the step size into the denominator because ``addcdiv_`` takes no tensor ``value``::

    denom = sqrt(v) / (sqrt(bc2) * -step_size) + eps / -step_size
    param.addcdiv_(m, denom)

With ``lr = 0`` (a warmup that starts at zero: transformers' linear and cosine schedules do) and
an element whose gradient has always been exactly zero (a dead ReLU unit, an embedding row no
batch used, a masked weight), ``v = m = 0`` and ``0 / -0.0`` writes NaN into the parameter, where
eager's non-capturable step leaves it unchanged. Stock ``torch.compile`` of the same optimizer
does the same (pytorch/pytorch#126514). :func:`fold_step_size_after_eps` rewrites each such
update, in both doors' aten graphs, to eager's arithmetic::

    param + (-step_size * m) / (sqrt(v) / sqrt(bc2) + eps)

(``addcdiv``'s CPU kernel computes ``self + value * t1 / t2`` in that order), with the
denominator in the state's dtype as eager keeps it and the quotient in the parameter's opmath
dtype (a bfloat16 parameter's update rounded once, as eager's kernel does).

Requires ``meta["val"]`` on the graph's nodes (fake tensors). Matches the capturable pattern on
op targets only (an ``addcdiv`` without ``value`` whose divisor is that sum); guarantees every
rewritten update keeps its dtype, its consumers and its annotation, and other graphs are unchanged.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from spmd_backend.graph import ops
from spmd_backend.graph.meta import inherit
from spmd_backend.graph.utils import fake_mode_of, propagate_val

aten = torch.ops.aten


def _call(node: object, target: object) -> bool:
    return isinstance(node, fx.Node) and ops.is_call_to(node, target)


def _step_size_term(term: object, neg: fx.Node) -> object | None:
    """``eps`` when ``term`` is ``eps / neg`` (a division, or ``reciprocal(neg) * eps`` as
    Tensor's reversed division writes it); None otherwise."""
    if not isinstance(term, fx.Node) or term.kwargs:
        return None
    if _call(term, aten.div.Tensor) and term.args[1] is neg:
        return term.args[0]
    if _call(term, aten.mul.Tensor):
        for i in (0, 1):
            recip = term.args[i]
            if _call(recip, aten.reciprocal.default) and recip.args[0] is neg:
                return term.args[1 - i]
    return None


def _match(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node, fx.Node, object, fx.Node] | None:
    """(param, exp_avg, sqrt(v), sqrt(bc2), eps, -step_size) of a capturable Adam update."""
    if not _call(node, aten.addcdiv.default) or node.kwargs or len(node.args) != 3:
        return None
    param, exp_avg, denom = node.args
    if not _call(denom, aten.add.Tensor) or denom.kwargs or len(denom.users) != 1:
        return None
    quotient, eps_term = denom.args
    if not _call(quotient, aten.div.Tensor) or quotient.kwargs:
        return None
    sqrt_v, product = quotient.args
    if not _call(product, aten.mul.Tensor) or product.kwargs:
        return None
    for i in (0, 1):
        neg, bc2_sqrt = product.args[i], product.args[1 - i]
        if not _call(neg, aten.neg.default):
            continue
        eps = _step_size_term(eps_term, neg)
        if eps is not None:
            return param, exp_avg, sqrt_v, bc2_sqrt, eps, neg
    return None


def _opmath(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def fold_step_size_after_eps(graph: fx.Graph) -> int:
    """Rewrite the graph's capturable single-tensor Adam updates (see the module docstring);
    returns how many. The caller recompiles the graph module."""
    mode = fake_mode_of(graph)
    if mode is None:
        return 0
    count = 0
    for node in list(graph.nodes):
        found = _match(node)
        if found is not None:
            _rewrite(graph, node, found, mode)
            count += 1
    if count:  # the old denominators' chains
        graph.eliminate_dead_code(is_impure_node=ops.has_side_effect)
    return count


class _Builder:
    """New nodes before the update being replaced, with fake values and its annotation."""

    def __init__(self, graph: fx.Graph, update: fx.Node, mode: object) -> None:
        self.graph, self.update, self.mode = graph, update, mode
        self.opmath = _opmath(update.meta["val"].dtype)

    def call(self, target: object, *args: object, **kwargs: object) -> fx.Node:
        with self.graph.inserting_before(self.update):
            new = self.graph.call_function(target, args, kwargs)
        propagate_val(new, self.mode)
        if "spmd_phase" in self.update.meta:
            inherit(new, self.update)
        return new

    def up(self, value: fx.Node) -> fx.Node:
        """``value`` in the update's opmath dtype."""
        if value.meta["val"].dtype == self.opmath:
            return value
        return self.call(aten._to_copy.default, value, dtype=self.opmath)


def _rewrite(graph: fx.Graph, node: fx.Node, found: tuple, mode: object) -> None:
    param, exp_avg, sqrt_v, bc2_sqrt, eps, neg = found
    dtype = node.meta["val"].dtype
    b = _Builder(graph, node, mode)
    denom = b.call(aten.add.Tensor, b.call(aten.div.Tensor, sqrt_v, bc2_sqrt), eps)
    update = b.call(aten.div.Tensor, b.call(aten.mul.Tensor, b.up(exp_avg), neg), b.up(denom))
    out = b.call(aten.add.Tensor, param, update)
    if out.meta["val"].dtype != dtype:
        out = b.call(aten._to_copy.default, out, dtype=dtype)
    node.replace_all_uses_with(out)
    graph.erase_node(node)

