"""Python floats Dynamo made graph inputs (a scheduler's lr, momentum, betas) kept as tensors.

A float the step reads that changed between calls (``group["lr"]`` under any per-step
scheduler) is made dynamic by Dynamo on its recompile: the graph takes it as a 0-dim float64
tensor input and ``.item()``s it into a SymFloat. Where the step hands that SymFloat to an op as
a Python number (``p.add_(grad, alpha=-lr)`` of SGD and RMSprop, ``torch._foreach_div_(bc, lr)``
of foreach Adam, ``buf.mul_(momentum)``, a fused kernel's ``lr``), AOTAutograd's tensorify pass
cannot turn it into tensor compute and specializes it. A per-step schedule then compiled a new
graph on every call, and the call was refused at Dynamo's recompile limit. Worse, where
tensorify turns *some* uses of a float into tensor compute and bakes the value into others, it
does so without restarting Dynamo, and the AOTAutograd cache then serves the graph with the
old value baked in to the next value's recompile (stock ``torch.compile`` too): a stale value.

:func:`tensorify_float_inputs` runs on Dynamo's graph, before AOTAutograd, and decides per float
input, all or nothing:

* every use it knows how to keep (:mod:`spmd_backend.dynamo.float_uses`): each is rewritten to take a tensor twin of
  the SymFloat, ``ones(()) * s``, which tensorify turns into float64 tensor compute on the input
  (replaying ``-lr``, ``1 - beta``, ``lr * wd`` in IEEE double like Python) and counts as kept;
  the float stays a graph input and a schedule never recompiles;
* any other use (an op whose scalar semantics a tensor would change, a bfloat16 or float16
  operand, float arithmetic tensorify cannot replay): the float is specialized for the whole
  frame (``TensorifyState``, then a restart of Dynamo's analysis, as tensorify itself does): its
  value is baked into the graph and guarded, so a change recompiles, and at the recompile limit
  :mod:`spmd_backend.dynamo.audit` refuses the call before it runs. Never half of each.

Requires Dynamo's graph with ``example_value`` metadata (torch 2.13). Guarantees: no float is
rewritten in some uses and baked in others; a rewrite computes what the Python number did (as
:mod:`spmd_backend.dynamo.float_uses` qualifies).
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch
import torch.fx as fx

from spmd_backend.dynamo.float_uses import Apply, UseRewriter, number, value_of

log = logging.getLogger(__name__)

#: float arithmetic on a dynamic float that the twin replays (tensorify interprets its
#: expression): anything else bakes the float
_ARITHMETIC: frozenset = frozenset(
    {
        operator.neg, operator.add, operator.sub, operator.mul, operator.truediv, operator.pow,
        operator.abs, torch.sym_max, torch.sym_min, torch._sym_sqrt,
    }
)


def _float_symbols(node: fx.Node) -> frozenset:
    value = node.meta.get("example_value")
    if not isinstance(value, torch.SymFloat):
        return frozenset()
    return frozenset(value.node.expr.free_symbols)


def _root_symbol(node: fx.Node) -> Any:
    """The float symbol of ``node`` when it is Dynamo's ``.item()`` of a float input (a 0-dim
    float64 placeholder) that is still dynamic; None otherwise."""
    if node.op != "call_method" or node.target != "item" or len(node.args) != 1:
        return None
    source = node.args[0]
    value = value_of(source)
    if not (isinstance(source, fx.Node) and source.op == "placeholder"
            and isinstance(value, torch.Tensor) and value.dtype == torch.float64
            and value.dim() == 0):
        return None
    sym = node.meta.get("example_value")
    expr = getattr(getattr(sym, "node", None), "_expr", None)
    return expr if isinstance(sym, torch.SymFloat) and getattr(expr, "is_Symbol", False) \
        and expr in sym.node.expr.free_symbols else None


def _describe(node: fx.Node) -> str:
    target = node.target if isinstance(node.target, str) else getattr(
        node.target, "__name__", str(node.target))
    return f"{target} ({node.name})"


def tensorify_float_inputs(gm: fx.GraphModule) -> int:
    """Keep the dynamic float inputs of ``gm`` (Dynamo's graph) graph inputs where every use
    can take a tensor, and bake the others (see the module docstring). Returns the number of
    uses rewritten; raises Dynamo's ``TensorifyScalarRestartAnalysis`` (Dynamo restarts the
    frame with those floats baked) when some float has a use this module does not keep."""
    graph = gm.graph
    roots = {s: n for n in graph.nodes if (s := _root_symbol(n)) is not None}
    if not roots:
        return 0
    ours, root_nodes = frozenset(roots), set(roots.values())
    syms: set[fx.Node] = set()  # SymFloat nodes computed from the dynamic floats
    rewriter = UseRewriter(gm, syms)
    baked: dict[Any, str] = {}  # float symbol -> the use that bakes it
    plans: list[Apply] = []
    for node in graph.nodes:
        symbols = _float_symbols(node)
        if symbols & ours:
            is_root = node in root_nodes
            arithmetic = node.op == "call_function" and node.target in _ARITHMETIC \
                and not node.kwargs and all(a in syms or number(a) for a in node.args)
            if symbols <= ours and (is_root or arithmetic):
                syms.add(node)
            else:
                baked.update({s: _describe(node) for s in symbols & ours})
            continue
        used = [a for a in node.all_input_nodes if a in syms]
        if not used:
            continue
        apply = rewriter.plan(node)
        if apply is None:
            for a in used:
                baked.update({s: _describe(node) for s in _float_symbols(a) & ours})
        else:
            plans.append(apply)
    if baked:
        _bake(roots, baked)
    for apply in plans:
        apply()
    if plans:
        graph.lint()
        gm.recompile()
    return len(plans)


#: float symbols this module had Dynamo bake, until the restarted compile is done
_BAKED: set[str] = set()


def forget_baked() -> None:
    """Drop this module's bake requests once the frame they were for has compiled (or
    failed): Dynamo keeps ``TensorifyState`` across frames, and symbol names repeat, so a float
    of a later frame (another step, a resume function) would be baked too and recompile on
    every value. Not before the restarted compile's AOTAutograd has run: its tensorify pass
    would find the baked float unrequested and restart again."""
    from torch._dynamo.symbolic_convert import TensorifyState

    for name in _BAKED:
        TensorifyState.force_specializations.discard(name)
    _BAKED.clear()


def _bake(roots: dict[Any, fx.Node], baked: dict[Any, str]) -> None:
    """Have Dynamo restart the frame with the floats ``baked`` as constants (what AOTAutograd's
    tensorify pass does for a float it cannot keep), before anything is rewritten."""
    from torch._dynamo.exc import TensorifyScalarRestartAnalysis
    from torch._dynamo.symbolic_convert import TensorifyState

    for symbol, use in baked.items():
        source = roots[symbol].args[0]
        log.info('backend="spmd": the float input %s is used by %s, which needs a Python '
                 "number: Dynamo bakes its value into the graph (a change recompiles)",
                 getattr(source, "target", source), use)
        if not TensorifyState.should_specialize(str(symbol)):
            _BAKED.add(str(symbol))  # one of tensorify's own requests is not ours to drop
        TensorifyState.specialize(str(symbol))
    raise TensorifyScalarRestartAnalysis
