"""Work a compiled step moved into its next call, and who may read what it will write.

An ``iter_move_grads_and_optimizers`` transformation keeps a bucket's all_reduce and optimizer
update for the step's next call: between two calls, those parameters and their optimizer state
are one update behind. Requires: a step that calls :func:`hold` after each call that left such
work pending (with a callback that runs it) and :func:`release` once it ran.

Guarantees, while work is held for a module or an optimizer:

* Another compiled step called with the same module or optimizer runs the held work first
  (:func:`settle`, called by ``spmd_backend.compile`` before it binds a call): a compiled
  evaluation step between training steps reads the updated parameters. Every rank calls a
  compiled step, so the work's collective runs on every rank.
* ``module.state_dict()``, ``optimizer.state_dict()`` and an eager ``module(...)`` call outside
  any trace warn (once per kind of read, until the work next runs) that they read values one
  update behind, and
  name the fix: ``train_step.flush()`` on every rank first. They do not run the work themselves:
  its collective would run on the ranks that read alone (``if rank == 0: torch.save(...)``) and
  hang, or meet another collective of the other ranks and mix their data.
* ``module.load_state_dict()`` and ``optimizer.load_state_dict()`` outside any trace raise
  :class:`~spmd_backend.errors.SpmdUsageError` before anything is loaded: the held work (an
  update computed before the load) would be applied on top of the loaded state at the next
  call (a rollback to a checkpoint was 8.7e-3 off DDP after one more step, silently, until
  2026-11-28). The error names the fix, ``flush()`` on every rank before loading.
* The forward pre-hook is marked with :data:`INTERNAL_HOOK_ATTR`: the step cache key and the
  free-value walk skip it, so holding work never makes the step retrace.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn as nn

from spmd_backend.errors import SpmdUsageError
from spmd_backend.tracing.key import INTERNAL_HOOK_ATTR

log = logging.getLogger(__name__)

#: what a holder is told: run the held work now, because of ``why``
Flush = Callable[[str], None]


class _Holder:
    """One step's held work: how to run it, what it names itself, what it warned about."""

    def __init__(self, flush: Flush, name: str) -> None:
        self.flush = flush
        self.name = name
        self.warned: set[str] = set()


#: module or optimizer -> the holder of the work that will write it
_HELD: weakref.WeakKeyDictionary[Any, _Holder] = weakref.WeakKeyDictionary()
#: objects whose state-dict hooks are installed (kept for their lifetime: a dict lookup)
_STATE_HOOKED: weakref.WeakSet[Any] = weakref.WeakSet()
#: module -> its forward pre-hook's handle, while work is held for it
_FORWARD: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


def _tracing() -> bool:
    """True inside a trace (make_fx's proxy mode, Dynamo): a read there is not a user's read."""
    if torch.compiler.is_compiling():
        return True
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    return get_proxy_mode() is not None


def _warn(obj: Any, what: str) -> None:
    if _tracing():
        return
    holder = _HELD.get(obj)
    if holder is None or what in holder.warned:
        return
    holder.warned.add(what)
    warnings.warn(
        f"{what} while {holder.name} holds work for its next call (an "
        "iter_move_grads_and_optimizers transformation moved a bucket's all_reduce and "
        "optimizer update there): the moved parameters and their optimizer state are one "
        f"update behind. Call {holder.name}.flush() on every rank first (or pass "
        "last_train_step=True to the last call before reading).",
        stacklevel=3,
    )


def _module_state_dict_hook(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    _warn(module, f"{type(module).__qualname__}.state_dict() was read")


def _optimizer_state_dict_hook(optimizer: torch.optim.Optimizer) -> None:
    _warn(optimizer, f"{type(optimizer).__qualname__}.state_dict() was read")


def _refuse_load(obj: Any) -> None:
    holder = _HELD.get(obj)
    if holder is None or _tracing():
        return
    raise SpmdUsageError(
        f"{type(obj).__qualname__}.load_state_dict() while {holder.name} holds work for its next "
        "call (an iter_move_grads_and_optimizers transformation moved a bucket's all_reduce and "
        "optimizer update there): that update, computed before this load, would be applied on "
        f"top of the loaded state. Call {holder.name}.flush() on every rank before loading; "
        "nothing was loaded."
    )


def _module_load_pre_hook(module: nn.Module, *_: Any) -> None:
    _refuse_load(module)


def _optimizer_load_pre_hook(optimizer: torch.optim.Optimizer, state_dict: Any) -> None:
    _refuse_load(optimizer)


def _forward_pre_hook(module: nn.Module, args: Any) -> None:
    _warn(module, f"{type(module).__qualname__} was called outside the compiled step")


for _hook in (_forward_pre_hook, _module_load_pre_hook):
    setattr(_hook, INTERNAL_HOOK_ATTR, True)


def hold(objs: Iterable[Any], flush: Flush, name: str) -> None:
    """Record that ``flush`` must run before ``objs`` (modules, optimizers) are read."""
    for obj in objs:
        if obj is None:
            continue
        previous = _HELD.get(obj)
        if previous is None or previous.flush != flush:  # else: held since an earlier call
            _HELD[obj] = _Holder(flush, name)
        if obj not in _STATE_HOOKED:
            _STATE_HOOKED.add(obj)
            if isinstance(obj, nn.Module):
                obj.register_state_dict_pre_hook(_module_state_dict_hook)
                obj.register_load_state_dict_pre_hook(_module_load_pre_hook)
            elif isinstance(obj, torch.optim.Optimizer):
                obj.register_state_dict_pre_hook(_optimizer_state_dict_hook)
                obj.register_load_state_dict_pre_hook(_optimizer_load_pre_hook)
        if isinstance(obj, nn.Module) and obj not in _FORWARD:
            _FORWARD[obj] = obj.register_forward_pre_hook(_forward_pre_hook)


def release(objs: Iterable[Any], flush: Flush) -> None:
    """The work ``flush`` runs has run: ``objs`` are current again."""
    for obj in objs:
        if obj is None:
            continue
        holder = _HELD.get(obj)
        if holder is not None and holder.flush == flush:
            del _HELD[obj]
            handle = _FORWARD.pop(obj, None)
            if handle is not None:
                handle.remove()


def settle(objs: Iterable[Any], flush: Flush, why: str) -> None:
    """Run the work other steps hold for ``objs`` (a step's own, ``flush``, is left held)."""
    for obj in objs:
        holder = _HELD.get(obj) if obj is not None else None
        if holder is not None and holder.flush != flush:
            log.info("spmd_backend: %s; first running the work %s moved into its next call",
                     why, holder.name)
            holder.flush(why)


class Held:
    """What one compiled step holds: after each call, its runner's pending moves decide
    whether ``objs`` (its module and optimizer) are held for ``flush``."""

    def __init__(self, flush: Flush, name: str) -> None:
        self.flush = flush
        self.name = name
        self.objs: tuple[Any, ...] = ()

    def after_call(self, runner: Any, objs: tuple[Any, ...]) -> None:
        if not getattr(runner, "pending_moves", 0):
            self.release()
            return
        if self.objs != objs:
            self.release()
        self.objs = objs
        hold(objs, self.flush, self.name)

    def release(self) -> None:
        if self.objs:
            release(self.objs, self.flush)
            self.objs = ()


__all__ = ["Held", "hold", "release", "settle"]
