"""Frames Dynamo gave up on, asked again at each call so that a new model's parameters are adopted.

When Dynamo cannot compile a frame of this backend (a graph break inside a loop: transformers'
``for block in self.h`` with a logging hook), it runs the frame eagerly and marks its code
skipped for good: no hook sees a later call. :mod:`~spmd_backend.dynamo.eager_guard` adopts the
trainable parameters the failing call reaches (per-graph mode reduces their eager gradients,
:mod:`~spmd_backend.dynamo.eager_grads`), but until 2026-11-28 a later call of the same code
with another model (the next fold of a cross-validation, a model rebuilt after a restart, a new
head) reached parameters nobody had adopted: their eager gradients were refused at the optimizer
step, where DDP trains them.

Now, for a frame that reached trainable parameters when Dynamo gave up on it, the skip applies
to that call only (``ConvertFrameReturn.apply_to_code=False``): each later call comes back to
Dynamo's frame callback, whose wrapper (eager_guard) finds the frame's mark with
:func:`given_up` first, hands the parameters this call reaches to the audit when any is new
(adopted, verified and broadcast once, as the first call's were) and skips the frame again
without tracing it (:func:`skip_this_call`).

Requires torch 2.13 internals: ``ConvertFrameReturn`` and its ``apply_to_code``,
``CatchErrorsWrapper.__call__`` (Dynamo's frame callback, given the code's ``frame_state``) and
``_handle_skip`` (given every callback's result), and the ``frame_state`` dict Dynamo keeps per
code object and clears in ``torch._dynamo.reset()`` (after which Dynamo tries the frame again,
as it would without this module). Costs: per call of such a frame, a walk over the parameters
it reaches (about 0.05 ms for a small model here).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

#: the ``frame_state`` key holding a code object's :class:`GivenUp`; local variable names,
#: Dynamo's other keys, cannot start with a space
_MARK = " spmd_given_up"

#: code objects whose skip, being decided now, must apply to the current call only
_THIS_CALL_ONLY: set[Any] = set()


@dataclass
class GivenUp:
    """Why Dynamo gave up on a code object, and the parameters its calls reached that were
    already handed to the gradient audit (by identity, weakly)."""

    reason: str
    seen: dict[int, weakref.ref] = field(default_factory=dict)

    def unseen(self, params: Iterable[torch.Tensor]) -> bool:
        """Whether any of ``params`` was not handed over yet (a new model, a new head)."""
        return any((ref := self.seen.get(id(p))) is None or ref() is not p for p in params)

    def handed_over(self, params: Iterable[torch.Tensor]) -> None:
        for p in params:
            key = id(p)
            self.seen[key] = weakref.ref(p, lambda _, k=key: self.seen.pop(k, None))


def mark_given_up(frame_state: Any, code: Any, reason: str,
                  params: Iterable[torch.Tensor]) -> None:
    """Dynamo gave up on ``code`` (``reason``) and runs this call eagerly, its ``params`` handed
    to the audit: ask again next call."""
    if isinstance(frame_state, dict):
        found = GivenUp(reason)
        found.handed_over(params)
        frame_state[_MARK] = found
        _THIS_CALL_ONLY.add(code)


def given_up(frame_state: Any) -> GivenUp | None:
    """What :func:`mark_given_up` recorded for the code whose ``frame_state`` this is."""
    found = frame_state.get(_MARK) if isinstance(frame_state, dict) else None
    return found if isinstance(found, GivenUp) else None


def this_call_only(result: Any, code: Any) -> Any:
    """``result`` (a skip Dynamo returns for ``code``) applied to this call only, when
    :func:`mark_given_up` asked for it."""
    if code in _THIS_CALL_ONLY:
        _THIS_CALL_ONLY.discard(code)
        if getattr(result, "guarded_code", None) is None and getattr(result, "apply_to_code", False):
            return dataclasses.replace(result, apply_to_code=False)
    return result


def skip_this_call(reason: str) -> Any:
    """What Dynamo's frame callback returns for a later call of a code it gave up on: run it
    eagerly, this call only, as Dynamo ran the call that gave up (its callees are still
    compiled)."""
    from torch._dynamo.types import ConvertFrameReturn

    return ConvertFrameReturn(apply_to_code=False, skip_reason=f'backend="spmd": {reason}')


__all__ = ["GivenUp", "given_up", "mark_given_up", "skip_this_call", "this_call_only"]
