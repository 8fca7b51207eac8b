"""Per-graph mode: gradients computed in frames Dynamo gave up on, reduced at the end of
``backward()`` as DDP reduces them.

A graph break inside a loop (transformers' ``for layer in self.layers`` with a logging hook or a
``.item()`` in each block) makes Dynamo give up on the whole function: it runs eagerly, and only
the frames it calls (each block's ``forward``) are compiled. The compiled backward graphs reduce
their parameters' gradients; the eager ones (embeddings, the final norm, a weight tied between the
embedding and a compiled head) were not reduced, and the audit refused such a step: DDP trains
these models, this backend could not. Now, for the trainable parameters a skipped frame reaches
(:func:`~spmd_backend.dynamo.audit.watch_skipped_frame` hands them to :meth:`EagerGradients.adopt`),
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
parameters, and includes whether it has any in the code it compares; the callback first agrees on
the list of parameters with an eager part (name, shape, dtype, in name order) with one all_reduce
of two int64 numbers, so ranks whose eager regions differ raise
:class:`~spmd_backend.errors.SpmdDistributedError` instead of summing one parameter's gradient
into another's.

Requires: a process group of two or more ranks with ``check_consistency`` on (without it, or
with ``shard_optimizer``, whose gradients the optimizer graph expects in another form, nothing is
adopted and an eager gradient is refused as before); a one-rank group needs no reduction (adopted
parameters train as they are). Guarantees: the gradient after ``backward()`` is the gradient before
it plus the compiled contributions plus the reduced eager part, equal to DDP's up to the rounding
of the subtraction (none when ``.grad`` was empty and nothing compiled contributed); with
``torch.autograd.grad`` (no accumulation) nothing is reduced or written, as with DDP. Costs: one
extra gradient-sized tensor per adopted parameter with an eager part until the callback, one small
all_reduce per ``backward()`` once a group has adopted parameters, and one all_reduce per dtype of
the eager parts.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from spmd_backend.dynamo import audit
from spmd_backend.parallel.consistency import signature_digest
from spmd_backend.parallel.data_parallel import DataParallel
from spmd_backend.parallel.schedule_check import agree_on_schedule


@dataclass
class _Part:
    """One parameter's gradient part that no compiled graph reduced, in one ``backward()``."""

    param: torch.Tensor
    fqn: str
    eager: torch.Tensor
    #: the compiled contributions' sum when the gradient mixed both, else None
    compiled: torch.Tensor | None
    #: ``.grad`` was empty before this ``backward()`` accumulated
    fresh: bool


@dataclass
class _Session:
    """The eager parts of one ``backward()`` (one autograd graph task) on one group."""

    owner: EagerGradients
    task: int
    parts: list[_Part] = field(default_factory=list)

    @torch.compiler.disable
    def finish(self) -> None:
        """Agree on the parts' list with every rank, reduce them, write ``.grad``."""
        owner = self.owner
        if owner.current is self:
            owner.current = None
        if owner.world == 1:
            return
        parts = sorted(self.parts, key=lambda p: p.fqn)
        lines = [f"{p.fqn} {list(p.eager.shape)} {p.eager.dtype}" for p in parts]
        agree_on_schedule(
            signature_digest(lines), owner.group,
            'backend="spmd" (per-graph mode, gradients of the regions Dynamo runs eagerly)',
            f" This rank computed eagerly the gradients of {len(parts)} parameter(s)"
            + (f", the first: {parts[0].fqn!r}." if parts else "."),
            device=parts[0].eager.device if parts else None,
            state="No parameter was updated; the gradients of this backward() hold unreduced "
            "parts: zero them before training on.",
        )
        by_kind: dict[tuple[torch.dtype, torch.device], list[_Part]] = {}
        for p in parts:
            by_kind.setdefault((p.eager.dtype, p.eager.device), []).append(p)
        for (dtype, _), group in by_kind.items():
            reduced = owner.reduce(torch.cat([p.eager.reshape(-1) for p in group]))
            offset = 0
            for p in group:
                n = p.eager.numel()
                part = reduced[offset:offset + n].view_as(p.eager).to(dtype)
                offset += n
                _write(p, part)


def _write(p: _Part, reduced: torch.Tensor) -> None:
    """``.grad`` holds (what it held) + compiled + local eager part: make the last the reduced."""
    grad = p.param.grad
    if grad is None:  # a hook of the user's dropped it: the reduced gradient is all there is
        p.param.grad = reduced if p.compiled is None else p.compiled + reduced
    elif p.fresh:
        grad.copy_(reduced if p.compiled is None else p.compiled + reduced)
    else:
        grad.add_(reduced - p.eager)


class EagerGradients:
    """The adopted parameters of one data-parallel configuration's process group, and the
    session of the running ``backward()``."""

    def __init__(self, mode: DataParallel, group: dist.ProcessGroup) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.average = mode.reduce_op == "avg"
        self.compression = mode.compression(self.world)
        self.adopted: dict[int, weakref.ref] = {}
        self.current: _Session | None = None

    def adopt(self, param: torch.Tensor, fqn: str) -> None:
        """Reduce ``param``'s eager gradient parts from now on (idempotent)."""
        key = id(param)
        if key in self.adopted and self.adopted[key]() is param:
            return
        audit.watch_incoming(param, fqn)
        hook = audit.incoming_audit_of(param)
        if hook is None:  # does not require grad
            return
        hook.adopt(self, param)
        self.adopted[key] = weakref.ref(param, lambda _, k=key: self.adopted.pop(k, None))

    def begin(self) -> _Session:
        """The running ``backward()``'s session, opened (its callback queued) on first use."""
        task = torch._C._current_graph_task_id()
        if self.current is None or self.current.task != task:
            self.current = _Session(self, task)  # a backward() that failed midway left its own
            torch.autograd.Variable._execution_engine.queue_callback(self.current.finish)
        return self.current

    def collect(self, param: torch.Tensor, fqn: str, eager: torch.Tensor,
                compiled: torch.Tensor | None, fresh: bool) -> None:
        """``eager``: the part of ``param``'s incoming gradient no compiled graph reduced."""
        self.begin().parts.append(_Part(param, fqn, eager, compiled, fresh))

    def reduce(self, flat: torch.Tensor) -> torch.Tensor:
        """DDP's reduction of a flat gradient buffer (a new tensor, in the buffer's dtype or the
        compression's)."""
        buf = flat.to(self.compression.dtype) if self.compression is not None else flat.clone()
        if self.average:
            buf.div_(self.world)
        dist.all_reduce(buf, group=self.group)
        return buf


#: (id of a process group, reduce op, compression) -> the parameters adopted for it (by group
#: object, as the per-graph check: a group destroyed and created again is another object)
_REGISTRIES: dict[tuple[int, str, str | None], EagerGradients] = {}


def for_mode(mode: DataParallel) -> EagerGradients | None:
    """The adopted-parameter registry of ``mode`` (its process group, reduce op and compression),
    or None where eager gradients stay refused (no process group, ``shard_optimizer``, or
    ``check_consistency`` off or the fake backend on several ranks)."""
    if not dist.is_available() or not dist.is_initialized() or mode.shard_optimizer:
        return None
    group = mode.process_group()
    if dist.get_world_size(group) > 1 and (not mode.check_consistency
                                           or dist.get_backend(group) == "fake"):
        return None
    key = (id(group), mode.reduce_op, mode.gradient_compression)
    found = _REGISTRIES.get(key)
    if found is None or found.group is not group:
        found = _REGISTRIES[key] = EagerGradients(mode, group)
    return found


def of_group(group: dist.ProcessGroup) -> list[EagerGradients]:
    """The registries of ``group`` that have adopted parameters."""
    return [r for r in _REGISTRIES.values() if r.group is group and r.adopted]


__all__ = ["EagerGradients", "for_mode", "of_group"]
