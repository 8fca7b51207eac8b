"""Per-graph mode, at each call of a forward graph: the parameters that call used, audited and
agreed with every rank before their gradients are reduced.

In per-graph mode (a graph break kept the step apart) each AOT backward graph reduces the
gradients of the parameters its forward graph received. Two facts are only known when the
forward graph is called, not when it is compiled:

* **which parameters it received.** Dynamo inlines ``nn.Module`` calls and passes parameters as
  graph inputs, so one compiled graph serves every module of the same shape and code: the graph
  of ``layers[0]`` (a graph break inside a transformer block) runs again for ``layers[1]``. Its
  backward reduces ``layers[1]``'s gradients correctly, but the audit, told the compile-time
  parameters, raised that ``layers[1]``'s gradient had not been reduced: such models could not
  train at all.
* **what the other ranks run at that point.** A value read from a tensor (``if x.item():``) or
  a layer skipped at random (LayerDrop) sends each rank down another path once both paths are
  compiled; no compile, hence no consistency round, runs, and where two layers have the same
  shapes the ranks' backward graphs summed one layer's gradient into the other's: training
  went wrong silently (0.0065 off DDP in the probe).

:func:`watching_each_call` wraps the compiled forward: after each call with gradients enabled
it finds the call's own backward node (the ``CompiledFunctionBackward`` of the AOT function,
identified by its ``_forward_cls``) and hooks it. Its post-hook records each reduced gradient
it produced (:func:`~spmd_backend.dynamo.audit.record_reduced`): once per parameter and
``backward()`` for the post-accumulate audit, each contribution for the incoming-gradient audit
(a parameter also used in an eager region raises instead of accumulating an unreduced part).
On groups of two or more ranks with ``check_consistency`` on, the node also carries what its
backward graph reduces (the digest of its parameters' names, shapes and dtypes, and the
parameters received), and its pre-hook runs :meth:`BackwardSchedule.check_from` when it is the first such node of a
``backward()`` to run: a walk of the autograd graph below it collects every checked node not yet
covered, in ``next_functions`` order, and one all_reduce of two int64 numbers
(:func:`~spmd_backend.parallel.schedule_check.agree_on_schedule`, on a CPU channel: no device
synchronization) compares a code of their digests and of the identity of their parameters
(numbered in the order each first reached a check, the same on every rank while they agree).

Requires: ranks that took the same path built the same autograd graph (the walk's order is the
graph's). Guarantees: when the ranks' codes differ every rank raises
:class:`~spmd_backend.errors.SpmdDistributedError` from ``backward()`` before the first
backward graph's collectives, no parameter updated. One check per ``backward()`` (one more for
each part of the autograd graph that a walk did not reach, e.g. two losses from separate
compiled parts summed eagerly); a forward without a backward (an evaluation on one rank) never
checks. Measured on 2 gloo ranks, 1 thread each (a model with four graph breaks, six checked
graphs, a 17-22 ms step, variants interleaved): 0.4 and 1.0 ms per step in two runs, against
6.6 ms for a check before every backward graph; the incoming-gradient audit adds 0.4 ms.
"""

from __future__ import annotations

import functools
import hashlib
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from spmd_backend.dynamo import audit, eager_grads
from spmd_backend.parallel.live_groups import forget_destroyed
from spmd_backend.parallel.schedule_check import agree_on_schedule

#: the autograd node that accumulates a leaf's gradient (a parameter input's edge)
AccumulateGrad = torch._C._functions.AccumulateGrad


@dataclass
class BackwardFacts:
    """What the backward compiler learned: the input positions whose gradients its graph
    reduces (None until it has compiled; AOTAutograd may compile it at the first backward)."""

    reduced: list[int] | None = None


#: attributes this module sets on the backward node of a checked forward call: what its
#: backward graph reduces (digest, parameters received, description), and that a check
#: covered it
_ENTRY = "_spmd_per_graph_entry"
_COVERED = "_spmd_per_graph_checked"
#: set on every backward node this module hooked (an earlier call's node is never this call's)
_SEEN = "_spmd_per_graph_seen"


class BackwardSchedule:
    """One process group's check of the backward graphs a ``backward()`` is about to run, and
    its numbering of the parameters they reduce, in the order each first reached a check (the
    same on every rank while they agree)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self._numbers: dict[int, tuple[weakref.ref, int]] = {}
        self._next = 0

    def _number(self, params: Sequence[torch.Tensor]) -> tuple[list[int], list[torch.Tensor]]:
        """Each parameter's number; parameters seen for the first time get the next numbers
        provisionally (returned second, recorded by :meth:`_record` once agreed)."""
        numbers: list[int] = []
        new: dict[int, tuple[int, torch.Tensor]] = {}  # by id: tensors compare elementwise
        for p in params:
            known = self._numbers.get(id(p))
            if known is not None and known[0]() is p:
                numbers.append(known[1])
                continue
            numbers.append(new.setdefault(id(p), (self._next + len(new), p))[0])
        return numbers, [p for _, p in new.values()]

    def _record(self, new: list[torch.Tensor]) -> None:
        for p in new:
            key = id(p)
            self._numbers[key] = (weakref.ref(p, lambda _, k=key: self._numbers.pop(k, None)),
                                  self._next)
            self._next += 1

    def check_from(self, node: Any) -> None:
        """Raise on every rank unless each is about to run the same checked backward graphs,
        on the same parameters, below ``node`` (the first of them to run that no earlier check
        covered): a walk of the autograd graph from ``node``, in ``next_functions`` order,
        which stops at nodes an earlier check covered."""
        found: list[Any] = []
        stack, seen = [node], set()
        while stack:
            n = stack.pop()
            if id(n) in seen:
                continue
            seen.add(id(n))
            found.append(n)
            if getattr(n, _COVERED, False):
                continue
            stack.extend(m for m, _ in reversed(n.next_functions) if m is not None)
        ours = [n for n in found if getattr(n, _ENTRY, (None,) * 4)[3] is self
                and not getattr(n, _COVERED, False)]
        numbers, new = self._number([p for n in ours for p in getattr(n, _ENTRY)[1]])
        lines = [getattr(n, _ENTRY)[0] for n in ours]
        # a group with parameters of eager regions (eager_grads) reduces their gradients at the
        # end of this backward(): every rank opens that session here, and they agree it exists
        eager = eager_grads.of_group(self.group)
        code = hashlib.sha256(f"{lines}:{numbers}:{len(eager)}".encode()).hexdigest()
        params = getattr(node, _ENTRY)[1]
        agree_on_schedule(
            code, self.group, 'backend="spmd" (per-graph mode)',
            f" This rank was about to run the backward graphs of {len(ours)} compiled "
            f"forward call(s), the first: {getattr(node, _ENTRY)[2]}.",
            state="No parameter was updated (zero the gradients before training on: where "
            "a backward() has separate compiled parts, those that ran before the check keep "
            "their gradients).",
            device=params[0].device if params else None,
        )
        self._record(new)
        for n in ours:
            setattr(n, _COVERED, True)
        for registry in eager:
            registry.begin()


#: id of a process group -> its check (one per group object: backward graphs of all frames share
#: it; a group destroyed and created again under the same name is another object)
_SCHEDULES: dict[int, BackwardSchedule] = {}


def backward_schedule(group: dist.ProcessGroup) -> BackwardSchedule:
    found = _SCHEDULES.get(id(group))
    if found is None or found.group is not group:
        forget_destroyed(_SCHEDULES, lambda schedule: schedule.group)
        found = _SCHEDULES[id(group)] = BackwardSchedule(group)
    return found


def _own_backward_node(out: Any, args: Sequence[Any], learned: list[type]) -> Any:
    """The autograd node of this call of the AOT function among ``out``'s grad_fns: the first
    ``BackwardCFunction`` found on an output that is not an input passed through (another
    graph's node); once learned, the node whose ``_forward_cls`` is that class, also behind a
    view AOTAutograd regenerated."""
    values = out if isinstance(out, (list, tuple)) else (out,)
    inputs = {id(a) for a in args if isinstance(a, torch.Tensor)}
    for v in values:
        if not isinstance(v, torch.Tensor) or v.grad_fn is None or id(v) in inputs:
            continue
        node = v.grad_fn
        for candidate in (node, *(n for n, _ in node.next_functions if n is not None)):
            cls = getattr(candidate, "_forward_cls", None)
            if cls is None or getattr(candidate, _SEEN, False):  # another call's node
                continue
            if not learned and candidate is node:
                learned.append(cls)
            if learned and cls is learned[0]:
                return candidate
    return None


@torch.compiler.disable  # autograd calls it from inside a compiled step's backward()
def _check_before(schedule: BackwardSchedule, node_ref: weakref.ref, _grads: Any) -> None:
    node = node_ref()
    if node is None:
        return
    if not getattr(node, _COVERED, False):
        schedule.check_from(node)
        return
    # a backward() again through a graph kept with retain_graph=True: the check of the first
    # one covered these graphs on every rank, and every rank runs them again, so the eager
    # regions' gradients of this backward() are reduced at its end too (before 2026-11-28 they
    # were refused as computed outside the compiled step, found in review)
    for registry in eager_grads.of_group(schedule.group):
        registry.begin()


@torch.compiler.disable
def _mark_after(facts: BackwardFacts, slots: list[tuple[int, Any, int, torch.Tensor]],
                grads: tuple, _out: Any) -> None:
    """The call's reduced gradients, for the parameters whose accumulation runs in this
    ``backward()`` (``torch.autograd.grad`` with respect to inputs accumulates nothing)."""
    reduced = set(facts.reduced or ())
    for k, acc, i, p in slots:  # the node's k-th input is parameter p, input i of the graph
        if i in reduced and k < len(grads) and grads[k] is not None \
                and audit.accumulates(acc):
            audit.record_reduced(p, grads[k])


def watching_each_call(
    compiled: Callable[..., Any], positions: list[int], fqns: dict[int, str],
    facts: BackwardFacts, digest: str, schedule: BackwardSchedule | None, where: str,
) -> Callable[..., Any]:
    """``compiled`` (a per-graph forward with trainable parameters at input ``positions``)
    auditing, and with ``schedule`` checking, the parameters each call received (the
    compile-time ones are not kept: a cached graph must not keep a model alive)."""
    learned: list[type] = []

    def run(*args: Any) -> Any:
        out = compiled(*args)
        if not torch.is_grad_enabled():
            return out
        node = _own_backward_node(out, args, learned)
        if node is None:  # no output needs a gradient: no backward graph will run
            return out
        used = {i: args[i] for i in positions}
        for i, p in used.items():  # a module sharing this graph: watched from its first call
            audit.watch(p, fqns[i])
            audit.watch_incoming(p, fqns[i])
        position = {id(p): i for i, p in used.items()}
        slots = [(k, m, position[id(m.variable)], m.variable)
                 for k, (m, _) in enumerate(node.next_functions)
                 if isinstance(m, AccumulateGrad) and id(m.variable) in position]
        setattr(node, _SEEN, True)
        if schedule is not None:
            setattr(node, _ENTRY, (digest, list(used.values()), where, schedule))
            node.register_prehook(functools.partial(_check_before, schedule, weakref.ref(node)))
        node.register_hook(functools.partial(_mark_after, facts, slots))
        return out

    return run


__all__ = ["BackwardFacts", "BackwardSchedule", "backward_schedule", "watching_each_call"]
