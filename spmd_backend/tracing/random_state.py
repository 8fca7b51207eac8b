"""Randomness in a traced step: what the replayed graph can repeat and what it cannot.

``spmd_backend.compile`` traces the step once and replays its graph; Python code runs only while
tracing. torch's random ops (``torch.rand``, dropout) are graph ops and draw anew on each call.
Three things around them were silently wrong before:

* **Checkpointed regions with dropout.** torch's checkpoint saves the generator state when a
  region runs forward and restores it before the recompute, so the recompute draws the same
  dropout mask. Saving and restoring a real generator while tracing puts nothing in the graph:
  the recompute drew a fresh mask, and the gradient of every checkpointed dropout was computed
  with another mask than the forward used (0.013 off eager after one step). While tracing,
  :class:`RandomReplay` stands in for the default generator's state: ``get_rng_state()``
  remembers how many random ops the trace has recorded, ``set_rng_state()`` of such a state
  makes the next random ops replay the recorded ones (the graph reuses their values; dropout is
  recomputed from its recorded mask, as torch's kernel computes it) instead of drawing again.
  The same holds for a step that saves and restores the state itself (``torch.random.fork_rng``
  around a side computation).
* **A number drawn from Python's or numpy's global generator** (``lam = np.random.beta(a, a)``
  for mixup, ``if random.random() < p:`` for stochastic depth) was drawn once and replayed as a
  constant (mixup trained with one fixed ``lam``). The drawing functions of the ``random``
  module and of ``numpy.random``'s global generator raise naming the line, and both generators'
  states are compared after the trace (a draw through another name, ``from random import
  random`` at import time, library code); both are left as they were.
* **``torch.manual_seed(k)`` in the step** (the same dropout masks per step index) ran once,
  while tracing. The step's own calls of ``manual_seed``, ``seed`` and ``set_rng_state`` of a
  state not taken during the trace raise naming the line.

Refusals are :class:`~spmd_backend.errors.SpmdUsageError`. Requires: the
:class:`~spmd_backend.tracing.dispatch.TraceMode` of the trace hands every op tagged
``nondeterministic_seeded`` to :meth:`RandomReplay.run`. Guarantees: every patched function and
the Python and numpy generators' states are restored when the context exits; the user's own
generator objects that :func:`~spmd_backend.tracing.free_values.random_generators` finds (``rng =
np.random.default_rng(0)``, ``self.rng = random.Random(0)``) are compared and restored too. Not
seen: a generator object reached only through a list or dict or through an installed package's
code, a ``torch.Generator`` seeded inside the step; torch ops given an explicit ``generator=`` are
run, never replayed (torch's checkpoint does not restore those either).
"""

from __future__ import annotations

import contextlib
import random
import sys
import traceback
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from spmd_backend.errors import SpmdTraceError, SpmdUsageError
from spmd_backend.tracing.errors import is_user_frame, user_frame

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


#: torch's functions that seed the default generator (set_rng_state is handled on its own)
_TORCH_SEEDING = ("manual_seed", "seed")

aten = torch.ops.aten


@dataclass
class RandomReplay:
    """The default generator's state as the trace sees it: a position in the recorded draws.

    ``recorded`` holds each random op the trace ran (op, and the values a replay reuses);
    ``cursor`` is the position of the next draw: at the end, a new draw is traced and recorded;
    before it (after ``set_rng_state`` of a state taken earlier), the recorded draw is reused.
    """

    recorded: list[tuple[Any, Any]] = field(default_factory=list)
    cursor: int = 0
    #: id of each real state tensor ``get_rng_state()`` returned while tracing -> (a weak
    #: reference to it, the cursor then); by identity (a tensor's ``==`` is elementwise)
    states: dict[int, tuple[Any, int]] = field(default_factory=dict)

    def got_state(self, state: torch.Tensor) -> None:
        self.states[id(state)] = (weakref.ref(state), self.cursor)

    def set_state(self, state: torch.Tensor) -> bool:
        """Move the cursor to where ``state`` was taken; False for a state taken elsewhere."""
        ref, position = self.states.get(id(state), (None, 0))
        if ref is None or ref() is not state:
            return False
        self.cursor = position
        return True

    def run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run (or replay) one op tagged ``nondeterministic_seeded``."""
        if kwargs.get("generator") is not None or not _draws(func, args, kwargs):
            return func(*args, **kwargs)
        if self.cursor == len(self.recorded):
            out = None
            if func is aten.bernoulli_.float:
                out = _bernoulli_in_memory_order(args[0], args[1] if len(args) > 1
                                                 else kwargs.get("p", 0.5))
            if out is None:
                out = func(*args, **kwargs)
            # an in-place draw's tensor may change later (drop path's ``div_``): keep a copy,
            # which dead-code elimination removes unless a replay reads it
            kept = aten.clone.default(out) if func._schema.is_mutable else out
            self.recorded.append((func, kept))
            self.cursor += 1
            return out
        recorded, kept = self.recorded[self.cursor]
        if recorded is not func:
            raise SpmdTraceError(
                f"a recomputed region draws random numbers with {func} where its forward drew "
                f"with {recorded}; the trace cannot replay the forward's draws"
            )
        self.cursor += 1
        if func is aten.native_dropout.default:  # recompute the output from the mask
            inp, p = args[0], args[1]
            scale = 0.0 if p == 1 else 1.0 / (1.0 - p)
            return aten.mul.Tensor(aten.mul.Tensor(inp, kept[1]), scale), aten.alias.default(kept[1])
        if func._schema.is_mutable:
            target = kwargs["out"] if "out" in kwargs else args[0]
            return target.copy_(kept)
        return pytree.tree_map_only(torch.Tensor, aten.alias.default, kept)


def _bernoulli_in_memory_order(target: torch.Tensor, p: float) -> torch.Tensor | None:
    """``target.bernoulli_(p)`` for a dense ``target`` whose memory order is not its logical
    order, drawn as eager's kernel draws: in memory order. Functionalization turns the in-place
    draw into ``bernoulli.p``, which fills a new contiguous tensor, so a transposed target (CPU
    dropout's noise for a batch-first attention's output) got another mask than eager's for the
    same generator state (the same numbers, placed differently): every ``nn.Transformer`` with
    dropout trained 0.012 off DDP after three SGD steps (hunt 32, 2026-11-28). Drawn here on the
    view that is contiguous, and put back in place. None where ``target`` is contiguous already
    (the functional form draws as eager does) or not dense: a hand-written ``bernoulli_`` into a
    strided slice still draws another mask than eager's (found in review; dropout's noise is
    always dense)."""
    order = sorted(range(target.dim()), key=lambda d: -target.stride(d))
    if order == list(range(target.dim())):
        return None
    dense = target.permute(order)
    if not dense.is_contiguous():
        return None
    drawn = aten.bernoulli.p(dense, p)
    return target.copy_(drawn.permute([order.index(d) for d in range(target.dim())]))


def _draws(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether this call of an op tagged ``nondeterministic_seeded`` draws random numbers: the
    attention kernels carry the tag for their dropout, and draw nothing at ``dropout_p=0`` (a
    checkpoint recompute then recomputes them instead of keeping the forward's outputs alive);
    dropout in eval mode draws nothing either."""
    for i, arg in enumerate(func._schema.arguments):
        if arg.name in ("dropout_p", "train"):
            value = kwargs[arg.name] if arg.name in kwargs else (
                args[i] if i < len(args) else arg.default_value)
            return value != 0 if arg.name == "dropout_p" else value is not False
    return True


def _seeding_refusal(name: str, where: str) -> SpmdUsageError:
    return SpmdUsageError(
        f"spmd_backend.compile: the train step calls torch.{name}() ({where}). The compile "
        "door traces the step once and replays its graph without running Python again, so the "
        "generator would be set once, while tracing, and never again. Seed before calling the "
        'compiled step, or compile with torch.compile(step, backend="spmd"). The model and the '
        "optimizer are unchanged."
    )


@dataclass
class _Generator:
    """A Python or numpy generator whose draws a trace would bake in."""

    description: str
    instance: Any
    #: the module whose functions draw from ``instance`` (patched to refuse), if any
    module: Any = None

    def get(self) -> Any:
        inst = self.instance
        if isinstance(inst, random.Random):
            return inst.getstate()
        if hasattr(inst, "bit_generator"):  # numpy.random.Generator
            return inst.bit_generator.state
        return inst.get_state()

    def set(self, state: Any) -> None:
        inst = self.instance
        if isinstance(inst, random.Random):
            inst.setstate(state)
        elif hasattr(inst, "bit_generator"):
            inst.bit_generator.state = state
        else:
            inst.set_state(state)


def _generators(own: Sequence[tuple[str, Any]]) -> list[_Generator]:
    """The global generators of Python and numpy, and ``own`` (the user's generator objects)."""
    found = [_Generator("Python's random module", random._inst, random)]  # type: ignore[attr-defined]
    np = sys.modules.get("numpy")
    if np is not None:
        found.append(_Generator("numpy.random's global generator", np.random.mtrand._rand,
                                np.random))
    found.extend(_Generator(f"{type(g).__name__} {label}", g) for label, g in own)
    return found


@contextlib.contextmanager
def traced_randomness(
    replay: RandomReplay, own_generators: Sequence[tuple[str, Any]] = ()
) -> Iterator[None]:
    """While active, torch's default-generator state is ``replay``'s, Python and numpy draws
    and the step's torch seeding raise; see the module doc. ``own_generators``: the user's
    generator objects the step can reach (``free_values.random_generators``)."""
    generators = _generators(own_generators)
    states = [g.get() for g in generators]
    patched: list[tuple[Any, str, Any]] = []

    def refusing(source: str, original: Any) -> Any:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise _refusal(source, user_frame(traceback.extract_stack()[:-1]))

        refuse.__wrapped__ = original  # type: ignore[attr-defined]
        return refuse

    def refusing_seed(name: str, original: Any) -> Any:
        def seed(*args: Any, **kwargs: Any) -> Any:
            caller = traceback.extract_stack()[-2]
            if is_user_frame(caller):
                raise _seeding_refusal(name, user_frame([caller]))
            return original(*args, **kwargs)

        seed.__wrapped__ = original  # type: ignore[attr-defined]
        return seed

    def getting_state(original: Any) -> Any:
        def get_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
            state = original(*args, **kwargs)
            replay.got_state(state)
            return state

        return get_rng_state

    def setting_state(original: Any) -> Any:
        def set_rng_state(state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            if not replay.set_state(state):  # a state not taken in the trace: seeding
                caller = traceback.extract_stack()[-2]
                if is_user_frame(caller):
                    raise _seeding_refusal("set_rng_state", user_frame([caller]))
            return original(state, *args, **kwargs)

        return set_rng_state

    def patch(module: Any, name: str, wrapper: Any) -> None:
        fn = getattr(module, name)
        patched.append((module, name, fn))
        setattr(module, name, wrapper(fn))

    try:
        # checkpoint and fork_rng look these up on torch, device modules on themselves
        devices = [torch.cuda] if torch.cuda.is_available() else []
        for module in (torch, torch.random, *devices):
            patch(module, "get_rng_state", getting_state)
            patch(module, "set_rng_state", setting_state)
        for module in (torch, torch.random):
            for name in _TORCH_SEEDING:
                patch(module, name, lambda fn, name=name: refusing_seed(name, fn))
        for g in generators:
            for name in getattr(g.module, "__all__", ()):
                fn = getattr(g.module, name, None)
                if name not in _STATE_FUNCTIONS and getattr(fn, "__self__", None) is g.instance:
                    patch(g.module, name, lambda fn, g=g: refusing(g.description, fn))
        yield
        for g, before in zip(generators, states):
            if not _same_state(g.get(), before):
                raise _refusal(g.description, "")
    finally:
        for module, name, fn in patched:
            setattr(module, name, fn)
        for g, before in zip(generators, states):
            g.set(before)


def _same_state(a: Any, b: Any) -> bool:
    """Equal generator states: nested tuples and dicts of numbers, and numpy's hold arrays."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            _same_state(a[k], b[k]) for k in a)
    if isinstance(a, tuple):
        return isinstance(b, tuple) and len(a) == len(b) and all(map(_same_state, a, b))
    equal = a == b
    return bool(equal.all()) if hasattr(equal, "all") else bool(equal)
