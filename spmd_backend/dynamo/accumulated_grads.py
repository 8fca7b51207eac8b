"""Several ``backward()`` calls in one Dynamo whole-step graph: reduce each gradient's total once.

Dynamo traces ``loss.backward()`` as ``torch.autograd.grad`` plus its ``accumulate_grad``
polyfill: the first backward copies its gradient into ``empty_like(param)`` (the new
``.grad``), each later one copies its own into another ``empty_like`` and adds that in place to
the first (``grad.add_(contribution)``). Marked one contribution at a time, each backward's
gradient was reduced on its own: twice the communication of DDP with ``no_sync`` (which
reduces the accumulated total once), and with ``gradient_compression`` a different result
(each part rounded to bfloat16 before the sum; 3.3e-4 off after six SGD steps, found in a bug
hunt on 2026-11-28). :func:`accumulated_total` recognizes that chain so that the backend marks
the total after the last addition instead, as the compile door does. Into a ``.grad`` that
exists when the step starts (``zero_grad(set_to_none=False)``), each backward's copy is added
to it in place; :func:`added_into_existing` and :func:`sum_before_adding` turn that into the
contributions' sum, marked once and then added.

Requires: a Dynamo graph before AOTAutograd (torch-level ``copy_``/``add_`` method calls).
Guarantees: only a chain nothing else reads between its first copy and its last addition is
recognized (a gradient the step reads in between, SAM's perturbation or a logged norm, keeps
one reduction per backward, which is what DDP's reader sees); the graph is not changed here.
"""

from __future__ import annotations

import torch
import torch.fx as fx


def copy_target(contribution: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """The ``empty_like`` that ``contribution`` is copied into, with the ``copy_`` node."""
    for use in contribution.users:
        if use.op == "call_method" and use.target == "copy_" and len(use.args) > 1 \
                and use.args[1] is contribution:
            dst = use.args[0]
            if isinstance(dst, fx.Node) and dst.op == "call_function" \
                    and dst.target is torch.empty_like:
                return dst, use
    return None


def _added_by(target: tuple[fx.Node, fx.Node]) -> fx.Node | None:
    """The one in-place ``x.add_(copy)`` that uses a contribution's copy (``target``: the copy's
    ``empty_like`` and ``copy_``), when that and the copy are all that use it."""
    dst, copy = target
    others = [u for u in dst.users if u is not copy]
    if len(others) != 1:
        return None
    add = others[0]
    if add.op == "call_method" and add.target == "add_" and len(add.args) == 2 \
            and add.args[1] is dst and not add.kwargs:
        return add
    return None


def accumulated_total(graph: fx.Graph, contributions: list[fx.Node]) -> tuple[fx.Node, fx.Node] | None:
    """For one parameter's gradients from several backward calls (in graph order): the
    ``.grad`` tensor they accumulate into and the last in-place addition, when they form the
    polyfill's chain and nothing reads the partial sum; else None."""
    if len(contributions) < 2:
        return None
    targets = [copy_target(c) for c in contributions]
    if any(t is None for t in targets):
        return None
    total, first_copy = targets[0]  # type: ignore[misc]
    adds = [_added_by(t) for t in targets[1:]]  # type: ignore[arg-type]
    if any(a is None or a.args[0] is not total for a in adds):
        return None
    order = {n: k for k, n in enumerate(graph.nodes)}
    last = max(adds, key=order.__getitem__)
    chain = {first_copy, *adds}
    if any(u not in chain and order[u] < order[last] for u in total.users):
        return None  # the partial sum is read between two backward calls
    return total, last


def added_into_existing(graph: fx.Graph, contributions: list[fx.Node]) -> list[fx.Node] | None:
    """For one parameter's gradients from several backward calls into a ``.grad`` that exists
    when the step starts (``zero_grad(set_to_none=False)``, accumulation across calls): the
    polyfill's ``grad.add_(copy)`` of each, in graph order, when they all add into the same
    ``.grad`` and nothing reads it between the first addition and the last; else None."""
    if len(contributions) < 2:
        return None
    targets = [copy_target(c) for c in contributions]
    if any(t is None for t in targets):
        return None
    found = [_added_by(t) for t in targets]  # type: ignore[arg-type]
    adds = [a for a in found if a is not None]
    if len(adds) != len(found):
        return None
    grad = adds[0].args[0]
    if not isinstance(grad, fx.Node) or any(a.args[0] is not grad for a in adds):
        return None
    order = {n: k for k, n in enumerate(graph.nodes)}
    adds.sort(key=order.__getitem__)
    first, last = order[adds[0]], order[adds[-1]]
    if any(u not in adds and first < order[u] < last for u in grad.users):
        return None  # the gradient is read between two backward calls
    return adds


def sum_before_adding(adds: list[fx.Node]) -> fx.Node:
    """Rewrite :func:`added_into_existing`'s chain ``grad.add_(c1) ... grad.add_(cn)`` into
    ``c1.add_(c2) ... c1.add_(cn); grad.add_(c1)`` (the last addition moved after the sum);
    returns the first addition, now ``grad.add_(c1)``, whose second argument the caller marks."""
    total = adds[0].args[1]
    for add in adds[1:]:
        add.args = (total, add.args[1])
    adds[-1].append(adds[0])  # grad.add_(c1) now follows the last partial sum
    return adds[0]


__all__ = ["accumulated_total", "added_into_existing", "copy_target", "sum_before_adding"]
