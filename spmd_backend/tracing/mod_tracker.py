"""ModTracker: which modules are running, in forward and in backward.

A context manager (global module forward hooks plus multi-grad hooks on module inputs and
outputs) maintaining:

* ``parents``: the FQNs (``"Root.child.0"``, class-name rooted, as upstream) of every module
  whose forward, or whose backward, is running; it always contains ``"Global"``;
* ``is_bw``: whether the autograd engine is running;
* ``get_known_fqn(module)``;
* optional user hooks ``register_user_hooks(pre_fw, post_fw, pre_bw, post_bw)`` (an
  AssertionError if one is already registered), cleared by ``clear_user_hooks()``.

Backward of a module starts when the gradients of its outputs arrive (pre_bw) and ends when
the gradients of its inputs are computed (post_bw). A module whose inputs need no gradient gets
its post_bw when the backward pass ends, innermost first. Modules freed before the backward give
``None`` to the backward hooks. Activation-checkpoint recompute runs the module's forward again
during backward, which the forward hooks report with ``is_bw`` true.

Requires: no concurrent backward passes (the end-of-backward callback is per engine run).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._pytree import tree_leaves

from spmd_backend.errors import SpmdTraceError

__all__ = ["ModTracker"]


def _grad_tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor) and t.requires_grad]


class ModTracker:
    """Track the module hierarchy during forward and backward (see the module docstring)."""

    parents: set[str]

    def __init__(self) -> None:
        self.parents = {"Global"}
        self._active: dict[str, int] = {}
        self._known: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._expanded: weakref.WeakSet = weakref.WeakSet()
        self._callback_queued = False
        self._pending_post_bw: list[Callable[[], None]] = []
        self._user_pre_fw: Callable[..., Any] | None = None
        self._user_post_fw: Callable[..., Any] | None = None
        self._user_pre_bw: Callable[..., Any] | None = None
        self._user_post_bw: Callable[..., Any] | None = None
        self._handles: list[Any] = []
        # modules whose current forward had no grad-requiring input -> their post_bw callback
        self._no_input_grad: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    # ------------------------------------------------------------------ public API
    @property
    def is_bw(self) -> bool:
        """True while the autograd engine runs a backward pass."""
        return torch._C._current_graph_task_id() != -1

    def get_known_fqn(self, mod: torch.nn.Module) -> str | None:
        """The FQN of ``mod`` if the tracker has seen it, else None."""
        return self._known.get(mod, None)

    def register_user_hooks(
        self,
        pre_fw_hook: Callable[..., Any] | None = None,
        post_fw_hook: Callable[..., Any] | None = None,
        pre_bw_hook: Callable[..., Any] | None = None,
        post_bw_hook: Callable[..., Any] | None = None,
    ) -> None:
        """Hooks called as ``pre_fw(mod, input)``, ``post_fw(mod, input, output)``,
        ``pre_bw(mod, grad_output)``, ``post_bw(mod, grad_input)``; the module is in
        ``parents`` while each runs. Raises AssertionError when one is already registered."""

        def merge(new: Callable[..., Any] | None, old: Callable[..., Any] | None, what: str):
            if new is not None and old is not None:
                raise AssertionError(
                    f"Only one {what} can be registered at a time; call clear_user_hooks() "
                    "before registering a new one"
                )
            return new if new is not None else old

        self._user_pre_fw = merge(pre_fw_hook, self._user_pre_fw, "pre_fw_hook")
        self._user_post_fw = merge(post_fw_hook, self._user_post_fw, "post_fw_hook")
        self._user_pre_bw = merge(pre_bw_hook, self._user_pre_bw, "pre_bw_hook")
        self._user_post_bw = merge(post_bw_hook, self._user_post_bw, "post_bw_hook")

    def clear_user_hooks(self) -> None:
        """Remove every user hook."""
        self._user_pre_fw = self._user_post_fw = None
        self._user_pre_bw = self._user_post_bw = None

    # ------------------------------------------------------------------ bookkeeping
    def _name(self, mod: torch.nn.Module) -> str:
        name = self._known.get(mod)
        if name is None:
            name = type(mod).__name__
            self._known[mod] = name
        if mod not in self._expanded:
            self._expanded.add(mod)
            for child_name, child in mod.named_children():
                self._known[child] = f"{name}.{child_name}"
                self._name(child)
        return name

    def _on_backward_end(self) -> None:
        while self._pending_post_bw:
            self._pending_post_bw.pop()()
        self.parents = {"Global"}
        self._active.clear()
        self._callback_queued = False

    def _ensure_callback(self) -> None:
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
            self._callback_queued = True

    def _enter(self, w_mod: weakref.ref, name: str, is_bw: bool) -> Callable[..., None]:
        def enter(*grads: Any) -> None:
            if is_bw:
                self._ensure_callback()
            elif name in self.parents and not self.is_bw:
                warnings.warn(
                    f"ModTracker: {name} entered while already running; the module hierarchy "
                    "may be wrong (is the module re-entered recursively?)",
                    stacklevel=2,
                )
            self._active[name] = self._active.get(name, 0) + 1
            self.parents.add(name)
            if is_bw and self._user_pre_bw is not None:
                self._user_pre_bw(w_mod(), grads)

        return enter

    def _leave(self, w_mod: weakref.ref, name: str, is_bw: bool) -> Callable[..., None]:
        def leave(*grads: Any) -> None:
            if is_bw and self._user_post_bw is not None:
                self._user_post_bw(w_mod(), grads)
            count = self._active.get(name, 0)
            if name in self.parents and count > 0:
                if count == 1:
                    del self._active[name]
                    self.parents.discard(name)
                else:
                    self._active[name] = count - 1
            elif not self.is_bw:
                raise SpmdTraceError(f"ModTracker: {name} left without having entered")

        return leave

    def _fw_pre_hook(self, mod: torch.nn.Module, args: Any) -> None:
        name = self._name(mod)
        w_mod = weakref.ref(mod)
        self._enter(w_mod, name, False)()
        if self._user_pre_fw is not None:
            self._user_pre_fw(mod, args)
        if self.is_bw:
            return  # a recompute (activation checkpointing): no new backward hooks
        inputs = _grad_tensors(args)
        leave_bw = self._leave(w_mod, name, True)
        if inputs:
            register_multi_grad_hook(inputs, leave_bw)
        else:
            self._no_input_grad[mod] = leave_bw

    def _fw_post_hook(self, mod: torch.nn.Module, args: Any, output: Any) -> None:
        name = self._name(mod)
        w_mod = weakref.ref(mod)
        if self._user_post_fw is not None:
            self._user_post_fw(mod, args, output)
        self._leave(w_mod, name, False)()
        if self.is_bw:
            return
        outputs = _grad_tensors(output)
        pending = self._no_input_grad.pop(mod, None)
        if outputs:
            enter_bw = self._enter(w_mod, name, True)
            if pending is not None:
                # no input needs a gradient: post_bw comes when the backward pass ends
                def enter_then_schedule_leave(*grads: Any, _leave: Any = pending) -> None:
                    enter_bw(*grads)
                    self._pending_post_bw.append(_leave)

                register_multi_grad_hook(outputs, enter_then_schedule_leave)
            else:
                register_multi_grad_hook(outputs, enter_bw)

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> ModTracker:
        self._handles = [
            register_module_forward_pre_hook(self._fw_pre_hook),
            register_module_forward_hook(self._fw_post_hook, always_call=True),
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
