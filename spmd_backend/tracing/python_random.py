"""Random numbers a step draws from Python's or numpy's global generator are refused by the compile door.

``lam = np.random.beta(a, a)`` (mixup), ``if random.random() < p:`` (stochastic depth, random
augmentation): ``spmd_backend.compile`` traces the step once, so such a number would be drawn
once and replayed as a constant by every later call (it was, silently: mixup trained with one
fixed ``lam``). torch's generators are graph ops and draw anew on each call; Python's and
numpy's are not. While a step is traced, :func:`refuse_python_randomness` makes the drawing
functions of the ``random`` module and of ``numpy.random``'s global generator raise
:class:`~spmd_backend.errors.SpmdUsageError` naming the line, and compares both generators'
states after the trace, which also catches draws through another name (``from random import
random``, library code). Either way the generators are left as they were before the trace.

Requires: nothing (numpy only if the process imported it). Guarantees: the patched functions
and the generators' states are restored when the context exits. A generator object of the
user's own (``random.Random(0)``, ``np.random.default_rng()``) is not seen.
"""

from __future__ import annotations

import contextlib
import random
import sys
import traceback
from collections.abc import Iterator
from typing import Any

from spmd_backend.errors import SpmdUsageError
from spmd_backend.tracing.errors import user_frame

#: functions of a generator module that set or read its state without drawing
_STATE_FUNCTIONS = frozenset({"getstate", "setstate", "get_state", "set_state", "seed"})


def _refusal(source: str, where: str) -> SpmdUsageError:
    at = f" ({where})" if where else ""
    return SpmdUsageError(
        f"spmd_backend.compile: the train step draws a random number from {source}{at}. The "
        "compile door traces the step once, so the number would be drawn once and replayed by "
        "every later call. Draw it with torch (torch.rand, torch.distributions: a tensor, drawn "
        "anew each call; torch.where instead of an if on it), draw it outside the step and pass "
        'it in as an argument, or compile with torch.compile(step, backend="spmd"). The model, '
        "the optimizer and the random generators are unchanged."
    )


def _generators() -> list[tuple[str, Any, Any, Any]]:
    """(description, module, global generator instance, get-state function) of each generator."""
    found: list[tuple[str, Any, Any, Any]] = [
        ("Python's random module", random, random._inst, random.getstate)  # type: ignore[attr-defined]
    ]
    np = sys.modules.get("numpy")
    if np is not None:
        legacy = np.random.mtrand._rand
        found.append(("numpy.random's global generator", np.random, legacy, legacy.get_state))
    return found


@contextlib.contextmanager
def refuse_python_randomness() -> Iterator[None]:
    """While active, draws from Python's and numpy's global generators raise; see the module doc."""
    generators = _generators()
    states = [get() for _, _, _, get in generators]
    patched: list[tuple[Any, str, Any]] = []

    def refusing(source: str, original: Any) -> Any:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise _refusal(source, user_frame(traceback.extract_stack()[:-1]))

        refuse.__wrapped__ = original  # type: ignore[attr-defined]
        return refuse

    try:
        for source, module, instance, _ in generators:
            for name in getattr(module, "__all__", ()):
                fn = getattr(module, name, None)
                if name not in _STATE_FUNCTIONS and getattr(fn, "__self__", None) is instance:
                    patched.append((module, name, fn))
                    setattr(module, name, refusing(source, fn))
        yield
        for (source, _, _, get), before in zip(generators, states):
            if not _same_state(get(), before):
                raise _refusal(source, "")
    finally:
        for module, name, fn in patched:
            setattr(module, name, fn)
        random.setstate(states[0])
        if len(generators) > 1:
            generators[1][2].set_state(states[1])


def _same_state(a: Any, b: Any) -> bool:
    """Equal generator states: nested tuples of numbers, and numpy's holds an array."""
    if isinstance(a, tuple):
        return isinstance(b, tuple) and len(a) == len(b) and all(map(_same_state, a, b))
    equal = a == b
    return bool(equal.all()) if hasattr(equal, "all") else bool(equal)
