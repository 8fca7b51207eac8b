"""Composable activation checkpointing: ``checkpoint(module)`` applied to a module in place.

``checkpoint(module)`` registers a forward pre-hook and an always-called forward hook on
``module`` and returns it: the module's forward then runs under torch's non-reentrant
checkpoint (its activations are not saved; the backward recomputes the forward, with the RNG
state restored so dropout/randn give identical gradients). ``checkpoint.state(module)`` is the
module's :class:`CheckpointState` (``enable_hook``, ``_ac_generator``, which is ``None``
whenever no checkpointed forward is in flight, also after an error in the forward or in the
recompute). Works on modules with several inputs and outputs, and while a whole step is traced
by ``spmd_backend.compile`` (the recompute appears in the backward as forward ops).

Requires torch's private ``torch.utils.checkpoint._checkpoint_without_reentrant_generator``
(pinned torch 2.13).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch.nn as nn
from torch.utils.checkpoint import _checkpoint_without_reentrant_generator

from spmd_backend.errors import SpmdTraceError, SpmdUsageError

__all__ = ["CheckpointState", "checkpoint"]


@dataclass
class CheckpointState:
    """Per-module checkpoint state."""

    enable_hook: bool = True
    _ac_generator: Iterator[None] | None = None
    preserve_rng_state: bool = True


_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def _hooks_disabled(state: CheckpointState) -> Iterator[None]:
    previous = state.enable_hook
    state.enable_hook = False
    try:
        yield
    finally:
        state.enable_hook = previous


class _Checkpoint:
    """The callable behind ``spmd_backend.checkpoint`` (with ``.state(module)``)."""

    def __call__(self, module: nn.Module, *, preserve_rng_state: bool = True) -> nn.Module:
        if not isinstance(module, nn.Module):
            raise SpmdUsageError(f"checkpoint(module): expected an nn.Module, got {type(module).__qualname__}")
        if module in _STATES:
            raise SpmdUsageError(f"checkpoint: {type(module).__name__} is already checkpointed")
        state = CheckpointState(preserve_rng_state=preserve_rng_state)
        _STATES[module] = state

        def pre_hook(mod: nn.Module, args: tuple, kwargs: dict) -> None:
            if not state.enable_hook:
                return

            def contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
                # the recompute calls the module again: its own checkpoint hooks stay out of it
                return contextlib.nullcontext(), _hooks_disabled(state)

            state._ac_generator = _checkpoint_without_reentrant_generator(
                mod, state.preserve_rng_state, contexts, "default", False, True, *args, **kwargs
            )
            next(state._ac_generator)

        def post_hook(mod: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            generator, state._ac_generator = state._ac_generator, None
            if not state.enable_hook or generator is None:
                return
            try:
                next(generator)
            except StopIteration:
                return
            raise SpmdTraceError("checkpoint: the checkpoint generator did not finish after forward")

        module.register_forward_pre_hook(pre_hook, prepend=True, with_kwargs=True)
        module.register_forward_hook(post_hook, prepend=False, with_kwargs=True, always_call=True)
        return module

    @staticmethod
    def state(module: nn.Module) -> CheckpointState:
        """The :class:`CheckpointState` of a checkpointed module."""
        try:
            return _STATES[module]
        except KeyError:
            raise SpmdUsageError(f"{type(module).__name__} is not checkpointed") from None


checkpoint = _Checkpoint()
