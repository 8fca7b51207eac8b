"""Per-graph mode: gradients computed in frames Dynamo gave up on, reduced at the end of
``backward()`` as DDP reduces them.

A graph break inside a loop (transformers' ``for layer in self.layers`` with a logging hook or a
``.item()`` in each block) makes Dynamo give up on the whole function: it runs eagerly, and only
the frames it calls (each block's ``forward``) are compiled. The compiled backward graphs reduce
their parameters' gradients; the eager ones (embeddings, the final norm, a weight tied between the
embedding and a compiled head) were not reduced, and the audit refused such a step: DDP trains
these models, this backend could not. The same holds for what runs eagerly between the pieces
of a frame a graph break splits: torch's modules, which Dynamo does not compile as frames (a
``BatchNorm`` with ``momentum=None`` broken at its ``.item()``, an ``LSTM`` given a
``PackedSequence``), and ``torch._dynamo.disable``-d functions given a parameter. Now, for the
trainable parameters a skipped frame reaches
(:func:`~spmd_backend.dynamo.audit.watch_skipped_frame` hands them to
:meth:`EagerGradients.adopt_frame`) or a frame compiled in pieces reaches (adopted when it
compiles: ``eager_guard._adopt_around_graph_breaks``),
the incoming-gradient hook of :mod:`~spmd_backend.dynamo.audit` passes the part of each gradient
that no compiled graph reduced (all of it, or the gradient less the compiled contributions) to
:meth:`EagerGradients.collect`, and one callback at the end of the ``backward()``
(:meth:`_Session.finish`) reduces every such part as DDP does (divided by the world size for
``reduce_op="avg"``, summed; in the configured compression dtype) and writes the result into
``.grad``: the reduced part replaces the local one, gradients accumulated before stay as they
were.

Every rank must run that callback in the same ``backward()``: a rank that queued none would
pair the others' collectives with its next step's. The per-graph check
(:meth:`~spmd_backend.dynamo.per_graph.BackwardSchedule.check_from`, once per ``backward()``
before any compiled collective) opens the session on every rank of a group that has adopted
parameters (ever: a dropped model's parameters are freed at each rank's own time when a reference
cycle holds them), and includes whether it has any in the code it compares; the callback first
agrees on the list of parameters with an eager part (name, shape, dtype, in name order) and on the
buffers it will broadcast with one all_reduce of two int64 numbers, so ranks whose eager regions
differ raise :class:`~spmd_backend.errors.SpmdDistributedError` instead of summing one
parameter's gradient into another's (where only the buffers differ, every rank collects its
garbage first and agrees again).

When a frame is adopted (all ranks compile it at the same call), its parameters and the buffers
of the modules it reaches are verified across ranks and broadcast from the group's first rank
once (``sync_module_states``, as DDP's constructor), and after each ``backward()`` the persistent
buffers (running statistics) are broadcast again (DDP's ``broadcast_buffers``, which DDP does
before the next forward: the values that forward reads are the same, unless a forward that
updates buffers runs between the steps on some ranks only, a train-mode evaluation on rank 0:
DDP's next forward broadcasts what it left, here the ranks keep their own until the step's
backward; found in review, 2026-11-28, left as it is). With
``check_finite_grads`` a non-finite reduced part raises :class:`~spmd_backend.errors.SpmdRuntimeError`
on every rank (the reduced values are the same everywhere) before anything is written.

Requires: a process group of two or more ranks with ``check_consistency`` on (without it, or
with ``shard_optimizer``, whose gradients the optimizer graph expects in another form, nothing is
adopted and an eager gradient is refused as before); a one-rank group needs no reduction (adopted
parameters train as they are). Guarantees: the gradient after ``backward()`` is the gradient before
it plus the compiled contributions plus the reduced eager part, equal to DDP's up to rounding:
the subtraction that separates a tied weight's eager part from its compiled one, and, with
``gradient_compression``, each part rounded to the compression dtype on its own (2.6e-4 off a
DDP ``bf16_compress_hook`` reference for a tied weight in review, 0 untied); none when ``.grad``
was empty and nothing compiled contributed. With ``torch.autograd.grad`` (no accumulation)
nothing is reduced or written, as with DDP. The reduced part is written as what ``.grad`` held
before this ``backward()`` plus the reduced gradient, so replicas stay bitwise equal.

A ``backward()`` run inside a node of the step's (a reentrant checkpoint's recompute and
backward: ``checkpoint_sequential(..., use_reentrant=True)``, which Dynamo does not compile) is
part of it: its parts join the running session, or, where none is open yet, are handed to the
enclosing ``backward()``'s when that node is done (a post hook on it). Before 2026-11-28 its own
end refused them as if it ran outside the compiled step.

A session reduces only when every rank runs it: the per-graph check opened it (a compiled
backward graph runs in this ``backward()`` on every rank), or a part of a frame Dynamo gave up
on arrived (that frame runs eagerly inside the step on every rank). The parameters of a frame
compiled in pieces are reached by any graph break, a logging call included; an eager
``backward()`` through them outside the compiled step (a saliency map on one rank) opens no
collective: its parts are refused on that rank (:class:`~spmd_backend.errors.SpmdUsageError`,
the optimizer step through this backend refuses them too), as before adoption. Costs: one extra
gradient-sized tensor per adopted parameter with an eager part until the callback (two where
``.grad`` held a value), one small all_reduce per ``backward()`` once a group has adopted
parameters, one all_reduce per (dtype, device) of the eager parts, and one coalesced broadcast
of the adopted frames' persistent buffers that no compiled graph broadcasts. Not run on a GPU
yet.
"""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from spmd_backend.dynamo import audit
from spmd_backend.dynamo.graphs import GRAPH_SYNCED_ATTR
from spmd_backend.errors import SpmdRuntimeError, SpmdUsageError
from spmd_backend.parallel.buffer_broadcast import BUCKET_BYTES
from spmd_backend.parallel.consistency import signature_digest
from spmd_backend.parallel.data_parallel import DataParallel
from spmd_backend.parallel.live_groups import forget_destroyed
from spmd_backend.parallel.schedule_check import agree_on_schedule, schedule_agrees
from spmd_backend.parallel.state_sync import sync_module_states


@dataclass
class _Part:
    """One parameter's gradient part that no compiled graph reduced, in one ``backward()``."""

    param: torch.Tensor
    fqn: str
    eager: torch.Tensor
    #: the compiled contributions' sum when the gradient mixed both, else None
    compiled: torch.Tensor | None
    #: a copy of ``.grad`` before this ``backward()`` accumulated into it, None when empty
    before: torch.Tensor | None


@dataclass
class _Session:
    """The eager parts of one ``backward()`` (one autograd graph task) on one group."""

    owner: EagerGradients
    task: int
    parts: list[_Part] = field(default_factory=list)
    #: every rank runs this session's collectives: the per-graph check opened it (a compiled
    #: backward graph runs in this backward() on every rank), or a part of a frame Dynamo gave
    #: up on arrived (that frame runs eagerly inside the step on every rank)
    collective: bool = False
    #: the callback queued on this session's graph task: autograd drops it when the task ends,
    #: finished or failed, so a session whose callback is gone and never ran is stale
    queued: weakref.ref | None = None
    done: bool = False

    def running(self) -> bool:
        """Its ``backward()`` is still running (a reentrant one may run inside it)."""
        return not self.done and self.queued is not None and self.queued() is not None

    def add(self, part: _Part) -> None:
        """One part per parameter: a second (a parameter used inside a reentrant checkpoint and
        outside it, or in two) adds to the first, whose ``before`` predates both."""
        for q in self.parts:
            if q.param is part.param:
                q.eager = q.eager + part.eager
                if part.compiled is not None:
                    q.compiled = part.compiled if q.compiled is None else q.compiled + part.compiled
                return
        self.parts.append(part)

    def _hand_up(self, node: Any) -> None:
        """A ``backward()`` run inside a node of another (a reentrant checkpoint's): its parts are
        the enclosing ``backward()``'s, reduced at its end; handed over once that node is done."""
        def absorb(*_: Any) -> None:
            if self.parts or self.collective:
                enclosing = self.owner.session()
                enclosing.collective = enclosing.collective or self.collective
                for part in self.parts:
                    enclosing.add(part)
                self.parts, self.collective = [], False
        node.register_hook(absorb)

    @torch.compiler.disable
    def finish(self) -> None:
        """Agree on the parts' list with every rank, reduce them, write ``.grad``; or, in a
        ``backward()`` no rank-wide event opened (an eager backward outside the compiled step,
        a saliency map on one rank), refuse its eager parts without any collective."""
        owner = self.owner
        self.done = True
        if owner.current is self:
            owner.current = None
        if owner.world == 1:
            return
        node = torch._C._current_autograd_node()
        if node is not None:  # inside a node of an enclosing backward()
            self._hand_up(node)
            return
        if not self.collective:
            if self.parts:
                audit.unmark_reduced(p.param for p in self.parts)
                raise SpmdUsageError(
                    f'backend="spmd": the gradient of parameter {self.parts[0].fqn!r} (and '
                    f"{len(self.parts) - 1} more) was computed eagerly in a backward() that ran "
                    "no spmd-compiled graph with parameters on this rank (a backward() outside "
                    "the compiled step, or a step whose every parameter is used only in code "
                    "Dynamo does not compile: quantization-aware training, where it skips "
                    "torch's fake-quantize functions), so it was not synchronized across ranks; "
                    "the gradients stay as this rank computed them and an optimizer step "
                    "through backend=\"spmd\" refuses them. Compute such gradients inside the "
                    "compiled step, use torch.autograd.grad for a local quantity (a saliency "
                    "map), or train QAT with spmd_backend.compile")
            return
        parts = sorted(self.parts, key=lambda p: p.fqn)
        lines = [f"{p.fqn} {list(p.eager.shape)} {p.eager.dtype}" for p in parts]
        device = parts[0].eager.device if parts else None
        buffers = owner.live_buffers()
        if not schedule_agrees(signature_digest([*lines, *_buffer_lines(buffers)]), owner.group,
                               device):
            # the buffers the ranks hold differ when a dropped model is held by a reference
            # cycle (each rank's garbage collector frees it at its own time): collect on every
            # rank and agree again; the parameters' parts are not garbage
            buffers.clear()  # this list would keep them alive
            gc.collect()
            buffers = owner.live_buffers()
            agree_on_schedule(
                signature_digest([*lines, *_buffer_lines(buffers)]), owner.group,
                'backend="spmd" (per-graph mode, gradients of the regions Dynamo runs eagerly)',
                f" This rank computed eagerly the gradients of {len(parts)} parameter(s)"
                + (f", the first: {parts[0].fqn!r}" if parts else "")
                + f", and holds {len(buffers)} buffer(s) of the modules it reduces them for.",
                device=device,
                state="No parameter was updated; the gradients of this backward() hold "
                "unreduced parts: zero them before training on.",
            )
        by_kind: dict[tuple[torch.dtype, torch.device], list[_Part]] = {}
        for p in parts:
            by_kind.setdefault((p.eager.dtype, p.eager.device), []).append(p)
        results: list[tuple[_Part, torch.Tensor]] = []
        for (dtype, _), group in by_kind.items():
            reduced = owner.reduce(torch.cat([p.eager.reshape(-1) for p in group]))
            offset = 0
            for p in group:
                n = p.eager.numel()
                results.append((p, reduced[offset:offset + n].view_as(p.eager).to(dtype)))
                offset += n
        if owner.mode.check_finite_grads:  # the reduced values are the same on every rank
            bad = next((p.fqn for p, r in results if not bool(torch.isfinite(r).all())), None)
            if bad is not None:
                raise SpmdRuntimeError(
                    f"spmd_backend: non-finite gradient for {bad} (reduced at the end of "
                    "backward(), computed in a region Dynamo runs eagerly); no gradient of this "
                    "region was written and no parameter was updated"
                )
        for p, r in results:
            _write(p, r)
        owner.broadcast_buffers(buffers)


def _buffer_lines(buffers: list[torch.Tensor]) -> list[str]:
    """What the ranks must agree on before broadcasting ``buffers`` together."""
    return [f"buffer {list(b.shape)} {b.dtype}" for b in buffers]


def _write(p: _Part, reduced: torch.Tensor) -> None:
    """``.grad`` holds (what it held) + compiled + local eager part: make the last the reduced,
    computed from the copy of what it held (adding ``reduced - eager`` to it left each rank's
    own rounding of the local part: replicas 1e-10 apart after 40 steps in review)."""
    grad = p.param.grad
    total = reduced if p.compiled is None else p.compiled + reduced
    if grad is None:  # a hook of the user's dropped it: the reduced gradient is all there is
        p.param.grad = total
    elif p.before is None:
        grad.copy_(total)
    else:
        grad.copy_(p.before + total)


class EagerGradients:
    """The adopted parameters of one data-parallel configuration's process group, and the
    session of the running ``backward()``."""

    def __init__(self, mode: DataParallel, group: dist.ProcessGroup) -> None:
        self.mode = mode
        self.group = group
        self.world = dist.get_world_size(group)
        self.average = mode.reduce_op == "avg"
        self.compression = mode.compression(self.world)
        self.adopted: dict[int, weakref.ref] = {}
        #: whether any parameter was ever adopted: the per-graph check opens a session from then
        #: on, decided the same way on every rank (adoption is collective), where the live
        #: ``adopted`` entries are not: a dropped model held by a reference cycle is freed when
        #: each rank's garbage collector runs
        self.ever_adopted = False
        #: persistent buffers of the modules adopted frames reach, broadcast after each backward()
        self.buffers: dict[int, weakref.ref] = {}
        #: parameters and buffers verified and broadcast from the first rank (once each)
        self.synced: dict[int, weakref.ref] = {}
        self.current: _Session | None = None

    def adopt_frame(self, values: list[Any], params: list[tuple[str, torch.Tensor]],
                    opens: bool = True) -> None:
        """A frame Dynamo gave up on (``opens``) or compiled in pieces reaches ``values`` (its
        modules' trainable ``params``, by FQN): verify them and the modules' buffers across
        ranks and broadcast them from the group's first rank (``sync_module_states``, once per
        tensor: what DDP's constructor does), then reduce the parameters' eager gradient parts
        from now on (:meth:`adopt`)."""
        tensors: dict[int, tuple[str, torch.Tensor]] = {id(p): (fqn, p) for fqn, p in params}
        for v in values:
            if not isinstance(v, torch.nn.Module):
                continue
            for prefix, module in v.named_modules():
                for name, b in module._buffers.items():
                    if b is None or id(b) in tensors:
                        continue
                    tensors[id(b)] = (f"{prefix}.{name}" if prefix else name, b)
                    if name not in module._non_persistent_buffers_set:
                        key = id(b)
                        self.buffers[key] = weakref.ref(b, lambda _, k=key: self.buffers.pop(k, None))
        # once per tensor: a frame Dynamo gave up on comes back at every call (given_up.py)
        named = [(n, t) for key, (n, t) in tensors.items()
                 if (ref := self.synced.get(key)) is None or ref() is not t]
        if self.world > 1 and named:
            sync_module_states([t for _, t in named], self.mode, [n for n, _ in named])
        for _, t in named:
            key = id(t)
            self.synced[key] = weakref.ref(t, lambda _, k=key: self.synced.pop(k, None))
        for fqn, p in params:
            self.adopt(p, fqn, opens)

    def live_buffers(self) -> list[torch.Tensor]:
        """The adopted frames' persistent buffers that :meth:`broadcast_buffers` broadcasts: those
        alive, not broadcast by a compiled graph at its start (``GRAPH_SYNCED_ATTR``), none
        without ``broadcast_buffers``."""
        if self.world == 1 or not self.mode.broadcast_buffers:
            return []
        return [b for ref in list(self.buffers.values())
                if (b := ref()) is not None and not getattr(b, GRAPH_SYNCED_ATTR, False)]

    def broadcast_buffers(self, buffers: list[torch.Tensor]) -> None:
        """DDP's ``broadcast_buffers``: ``buffers`` (:meth:`live_buffers`, agreed by every rank)
        from the group's first rank, after each ``backward()``, in one coalesced broadcast."""
        if buffers:
            with torch.no_grad():  # the group's first rank is the source (DataParallel.src_rank)
                dist._broadcast_coalesced(self.group, buffers, BUCKET_BYTES, 0)

    def adopt(self, param: torch.Tensor, fqn: str, opens: bool = True) -> None:
        """Reduce ``param``'s eager gradient parts from now on (idempotent; ``opens``: see
        :class:`_Session`'s ``collective``)."""
        key = id(param)
        if key in self.adopted and self.adopted[key]() is param:
            hook = audit.incoming_audit_of(param)
            if hook is not None:
                hook.opens = hook.opens or opens
            return
        audit.watch_incoming(param, fqn)
        hook = audit.incoming_audit_of(param)
        if hook is None:  # does not require grad
            return
        hook.adopt(self, param, opens)
        self.adopted[key] = weakref.ref(param, lambda _, k=key: self.adopted.pop(k, None))
        self.ever_adopted = True

    def session(self) -> _Session:
        """The running ``backward()``'s session, created (its callback queued) on first use. A
        ``backward()`` that runs inside a node of a running one (a reentrant checkpoint's
        recompute and backward) shares the enclosing one's session: its gradients are part of
        that ``backward()``'s, and only its end is the same on every rank."""
        task = torch._C._current_graph_task_id()
        found = self.current
        if found is not None and found.task != task and found.running():
            return found
        if found is None or found.task != task:
            found = self.current = _Session(self, task)  # replaces a stale one
            callback = found.finish
            found.queued = weakref.ref(callback)
            torch.autograd.Variable._execution_engine.queue_callback(callback)
        return found

    def begin(self) -> _Session:
        """The per-graph check, on every rank: this ``backward()``'s session reduces."""
        found = self.session()
        found.collective = True
        return found

    def collect(self, param: torch.Tensor, fqn: str, eager: torch.Tensor,
                compiled: torch.Tensor | None, opens: bool = True) -> None:
        """``eager``: the part of ``param``'s incoming gradient no compiled graph reduced (called
        before autograd accumulates it: ``.grad`` still holds what earlier backwards left)."""
        found = self.session()
        found.collective = found.collective or opens
        before = None if param.grad is None else param.grad.detach().clone()
        found.add(_Part(param, fqn, eager, compiled, before))

    def reduce(self, flat: torch.Tensor) -> torch.Tensor:
        """DDP's reduction of a flat gradient buffer (a new tensor, in the buffer's dtype or the
        compression's)."""
        buf = flat.to(self.compression.dtype) if self.compression is not None else flat.clone()
        if self.average:
            buf.div_(self.world)
        dist.all_reduce(buf, group=self.group)
        return buf


#: (id of a process group, the options the reduction reads) -> the parameters adopted for it (by
#: group object, as the per-graph check: a group destroyed and created again is another object)
_REGISTRIES: dict[tuple[Any, ...], EagerGradients] = {}


def for_mode(mode: DataParallel) -> EagerGradients | None:
    """The adopted-parameter registry of ``mode`` (its process group and the options it reads),
    or None where eager gradients stay refused (no process group, ``shard_optimizer``, or
    ``check_consistency`` off or the fake backend on several ranks)."""
    if not dist.is_available() or not dist.is_initialized() or mode.shard_optimizer:
        return None
    group = mode.process_group()
    if dist.get_world_size(group) > 1 and (not mode.check_consistency
                                           or dist.get_backend(group) == "fake"):
        return None
    key = (id(group), mode.reduce_op, mode.gradient_compression, mode.check_finite_grads,
           mode.broadcast_buffers, mode.sync_module_states)
    found = _REGISTRIES.get(key)
    if found is None or found.group is not group:
        forget_destroyed(_REGISTRIES, lambda registry: registry.group)
        found = _REGISTRIES[key] = EagerGradients(mode, group)
    return found


def of_group(group: dist.ProcessGroup) -> list[EagerGradients]:
    """The registries of ``group`` that have ever adopted parameters (not only those whose
    parameters live: until 2026-11-28 a dropped model freed by one rank's garbage collector
    and not yet by the other's made the per-graph check fail on every rank)."""
    return [r for r in _REGISTRIES.values() if r.group is group and r.ever_adopted]


__all__ = ["EagerGradients", "for_mode", "of_group"]
