"""LR scheduler steps inside a step that the compile door traces are refused, before they run.

``spmd_backend.compile`` runs the step's Python once, while tracing, and replays the graph
afterwards. ``scheduler.step()`` inside the step is Python on Python numbers (its epoch counter,
the new learning rate it writes into the param groups), so a replayed graph would never step
the schedule again. While a step is traced, :func:`refuse_scheduler_steps` makes every
``step`` of torch's LR schedulers (``LRScheduler`` and the subclasses that define their own:
``ReduceLROnPlateau``, ``SequentialLR``, ``ChainedScheduler``, ...; a transformers schedule is a
``LambdaLR``) raise :class:`~spmd_backend.errors.SpmdUsageError` naming the call and the fix
instead. The scheduler is refused on entry, so its counters and the learning rates are as
before; every rank traces the same step and raises the same error.

Requires: nothing. Guarantees: the methods are restored when the context exits.
"""

from __future__ import annotations

import contextlib
import inspect
import traceback
from collections.abc import Iterator
from typing import Any

from torch.optim import lr_scheduler

from spmd_backend.errors import SpmdUsageError
from spmd_backend.tracing.errors import user_frame


def _scheduler_classes() -> list[type]:
    return [
        cls for cls in vars(lr_scheduler).values()
        if inspect.isclass(cls) and issubclass(cls, (lr_scheduler.LRScheduler,
                                                     lr_scheduler.ReduceLROnPlateau))
        and "step" in vars(cls)
    ]


def _refusal(scheduler: Any) -> SpmdUsageError:
    where = user_frame(traceback.extract_stack()[:-2])
    at = f" (at {where})" if where else ""
    name = type(scheduler).__name__
    return SpmdUsageError(
        f"spmd_backend.compile: the train step calls {name}.step(){at}. A compiled step replays "
        "its graph without running the step's Python again, so the schedule would stop after "
        "the first call. Call scheduler.step() after the compiled step instead (the learning "
        "rate is an input of the graph: the new value is used by the next call, as in eager), "
        'or compile the step with torch.compile(step, backend="spmd"), which replays it. '
        "The scheduler, the optimizer and the model are unchanged."
    )


@contextlib.contextmanager
def refuse_scheduler_steps() -> Iterator[None]:
    """While active, ``step()`` of any torch LR scheduler raises (see the module doc)."""
    saved = [(cls, vars(cls)["step"]) for cls in _scheduler_classes()]

    def refusing(self: Any, *args: Any, **kwargs: Any) -> None:
        raise _refusal(self)

    try:
        for cls, _ in saved:
            cls.step = refusing  # type: ignore[method-assign]
        yield
    finally:
        for cls, original in saved:
            cls.step = original  # type: ignore[method-assign]
