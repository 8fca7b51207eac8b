"""Collectives a step issues itself (``dist.all_reduce(n_tokens)``) are refused by the compile door.

A step that normalizes its loss by the global token count all_reduces a count inside the step.
``spmd_backend.compile`` traces with make_fx, which does not capture torch.distributed's
in-place collectives as graph nodes: the trace failed with an internal error ("7 placeholders
for 6 planned inputs"). While a step is traced, :func:`refuse_user_collectives` makes the
collectives of ``torch.distributed`` raise :class:`~spmd_backend.errors.SpmdUsageError` naming
the call and the two ways out (compute it outside the step and pass it in; or
``torch.compile(step, backend="spmd")``, which captures it and matches DDP). The call is refused
before it runs, on every rank alike, so no rank waits for a peer.

A collective bound under another name before the trace (``from torch.distributed import
all_reduce``) is not patched; its op (namespace ``c10d``) reaches the trace's dispatch mode,
which raises the same refusal (:func:`refusal`; before, the trace failed with "internal: 5
placeholders for 4 planned inputs").

Requires: nothing. Guarantees: the functions are restored when the context exits.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from spmd_backend.errors import SpmdUsageError
from spmd_backend.tracing.errors import user_frame

#: torch.distributed's collectives a training step may call
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "broadcast", "reduce", "gather", "scatter", "all_to_all",
    "all_to_all_single", "barrier", "all_gather_object", "broadcast_object_list",
    "all_reduce_coalesced",
)


def refusal(what: str) -> SpmdUsageError:
    """The error for a collective the step calls (``what``: how to name it), at the user's
    line."""
    where = user_frame(traceback.extract_stack()[:-2])
    at = f" (at {where})" if where else ""
    return SpmdUsageError(
        f"spmd_backend.compile: the train step calls {what}{at}. The "
        "compile door traces the step into one graph and does not capture collectives the step "
        "issues itself. Compute the value outside the step and pass it in as an argument, or "
        'compile the step with torch.compile(step, backend="spmd"), which captures the '
        "collective. The model, the optimizer and the gradients are unchanged."
    )


@contextlib.contextmanager
def refuse_user_collectives() -> Iterator[None]:
    """While active, torch.distributed's collectives raise (see the module doc)."""
    saved = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def refusing(name: str) -> Any:
        def refuse(*args: Any, **kwargs: Any) -> None:
            raise refusal(f"torch.distributed.{name}()")

        return refuse

    try:
        for name in saved:
            setattr(dist, name, refusing(name))
        yield
    finally:
        for name, original in saved.items():
            setattr(dist, name, original)
