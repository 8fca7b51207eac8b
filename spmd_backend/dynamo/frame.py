"""What the frame Dynamo is compiling for the spmd backend reaches directly, and the names of
its modules' parameters.

Requires: :func:`parameter_names` entered by the scope's frame hook around a frame's compile
(``scope.install``). Guarantees: :func:`parameter_name` answers only while that frame is
compiled (None otherwise), from the modules among :func:`frame_values`; a parameter held by
several modules is named by the first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

_names: list[dict[int, str]] = []


def frame_values(code: Any, frame_locals: Any, frame_globals: Any, closure: Any) -> list[Any]:
    """What a frame reaches directly, in this order: arguments and locals, closure cells and
    the globals its code names."""
    values: list[Any] = list(dict(frame_locals or {}).values())
    for cell in closure or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    names = getattr(code, "co_names", ())
    values.extend(frame_globals[n] for n in names if isinstance(frame_globals, dict) and n in frame_globals)
    return values


@contextlib.contextmanager
def parameter_names(values: list[Any]) -> Iterator[None]:
    """While a frame is compiled: the FQN of every parameter of the modules among ``values``."""
    names: dict[int, str] = {}
    for v in values:
        if isinstance(v, torch.nn.Module):
            for name, p in v.named_parameters(remove_duplicate=False):
                names.setdefault(id(p), name)
    _names.append(names)
    try:
        yield
    finally:
        _names.pop()


def parameter_name(p: torch.Tensor) -> str | None:
    """The FQN of ``p`` in a module the frame being compiled reaches directly, or None."""
    return _names[-1].get(id(p)) if _names else None
