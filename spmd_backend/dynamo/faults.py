"""torch 2.13 Dynamo faults the whole-step scope works around (:mod:`spmd_backend.dynamo.scope`).

Each function returns ``(owner, attribute, replacement)`` patches that the scope installs while
one frame is traced for backend="spmd" and restores afterwards; each docstring says what torch
2.13 does wrong and what the replacement does. :func:`unsource_shared_constants` is the scope's
check after a frame. Requires: torch 2.13 (the scope installs nothing on another version).
Guarantees: nothing is patched by importing this module.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

#: (owner, attribute, replacement)
Patch = tuple[Any, str, Any]

#: ``id``s of the parameters held by the optimizers whose groups the frame being traced reads
#: (guarded by identity there, :func:`_guard_optimizer_identity`; the scope clears it per
#: frame): the backend guards the same objects where its graph reads them through the model
OPTIMIZER_PARAMS: set[int] = set()


def fault_patches() -> list[Patch]:
    """The patches for every fault below."""
    return [params_stay_graph_inputs(), *capturable_stays_out_of_param_groups(),
            optimizer_attribute_stores(), grad_stores_through_inplace_results(),
            hooks_added_later_recompile(), *fresh_constants_for_tensor_attributes()]


def hooks_added_later_recompile() -> Patch:
    """A forward (pre-)hook registered on a module after the step was compiled takes effect.

    With ``torch._dynamo.config.skip_nnmodule_hook_guards`` (True by default in torch 2.13)
    Dynamo does not check that a module's hook dict it found empty is still empty, so a hook
    added later (a feature-scaling hook, a pruning mask's pre-hook) was silently never run by
    the cached graph: 1.9e-2 off DDP after one step. A module's empty hook dicts are guarded on
    their length here, as a non-empty one always is: adding a hook recompiles. The guard
    function is captured when Dynamo records the guard, inside the scope, so it applies to the
    frames of this backend only."""
    from torch._dynamo.guards import GuardBuilder

    def guard_empty_hooks(self: Any, guard: Any) -> None:
        self.SEQUENCE_LENGTH(guard)

    original = GuardBuilder.__dict__["EMPTY_NN_MODULE_HOOKS_DICT"]
    guard_empty_hooks.__name__ = original.__name__
    guard_empty_hooks.guard_check_spec = getattr(original, "guard_check_spec", None)
    return GuardBuilder, "EMPTY_NN_MODULE_HOOKS_DICT", guard_empty_hooks


def params_stay_graph_inputs() -> Patch:
    """Reading ``optimizer.param_groups`` does not pin the parameters as graph attributes.

    Dynamo marks every parameter "static, guarded" the first time a frame reads
    ``param_groups`` (for CUDA graphs), and a tensor so marked is installed as a ``get_attr``
    rather than a graph input. ``loss.backward()`` then finds no parameters to differentiate
    (its leaves are the frame's inputs), so a step that calls ``optimizer.zero_grad()`` before
    the forward, the order most training loops use, lost its backward. Parameters stay inputs
    here, whichever object the frame reaches them through first; the backend lowers without
    CUDA graphs.

    That marking was also the only guard on *which* parameters the optimizer holds and which
    state belongs to which: the graph reads a group's parameters and the state's keys by
    position and checks only their shapes. Without it, a cached graph kept stepping the
    parameters and state it was traced with after the user re-pointed a group at a new head,
    swapped two groups' parameters, stepped a second model's group, or loaded a checkpoint
    that ordered the state differently (0.026 to 0.25 off eager, silently; stock
    ``torch.compile`` recompiles). :func:`_guard_optimizer_identity` guards those identities
    instead, and the backend the same parameters where the graph reads them through the model
    (:data:`OPTIMIZER_PARAMS`); a module's own frame, which no optimizer reaches, keeps sharing
    its graph between modules (the blocks of a model compiled in pieces)."""
    from torch._dynamo.variables.optimizer import OptimizerVariable
    from torch._dynamo.variables.user_defined import UserDefinedObjectVariable

    original = OptimizerVariable.var_getattr

    def var_getattr(self: Any, tx: Any, name: str) -> Any:
        if name == "param_groups":
            self._set_capturable(tx)
            _guard_optimizer_identity(self, tx)
            return UserDefinedObjectVariable.var_getattr(self, tx, name)
        return original(self, tx, name)

    return (OptimizerVariable, "var_getattr", var_getattr)


def _guard_optimizer_identity(optimizer_vt: Any, tx: Any) -> None:
    """Guard that every parameter of the optimizer's groups, and every key of its state, is
    the object it was at trace time, at the same position (a new object recompiles)."""
    from torch._dynamo.guards import GuardBuilder, install_guard
    from torch._dynamo.source import (
        AttrSource,
        ConstDictKeySource,
        DictGetItemSource,
        GetItemSource,
    )
    from torch._dynamo.variables import VariableTracker

    if optimizer_vt.source is None:  # an optimizer made inside the frame: nothing cached
        return
    opt = optimizer_vt.value
    groups = AttrSource(optimizer_vt.source, "param_groups")
    for i, group in enumerate(opt.param_groups):
        params = DictGetItemSource(GetItemSource(groups, i), "params")
        for j, p in enumerate(group["params"]):
            install_guard(GetItemSource(params, j).make_guard(GuardBuilder.ID_MATCH))
            OPTIMIZER_PARAMS.add(id(p))
    state = AttrSource(optimizer_vt.source, "state")
    VariableTracker.build(tx, opt.state, state).realize()
    tx.output.guard_on_key_order.add(state)
    for k in range(len(opt.state)):
        install_guard(ConstDictKeySource(state, k).make_guard(GuardBuilder.ID_MATCH))


def capturable_stays_out_of_param_groups() -> list[Patch]:
    """A step that writes a param group (``g["lr"] = warmup(it)``) leaves the group's
    ``capturable`` as it was.

    To trace an optimizer's step in its tensor form, Dynamo sets ``capturable`` to True in its
    own copy of every param group (only the copy: the group itself just on GPUs, before any
    state exists). A group the step writes is replayed after the call from that copy, so the
    user's group came back with ``capturable=True`` (an ``SGD`` gained the key; plain
    ``torch.compile`` too): an eager ``AdamW`` on the CPU then refused to step, and a
    checkpoint saved it. Each copy remembers the entry it had; when the side effects are
    written out (the trace is over), an entry the step did not write itself goes back to that
    (or away), so the replay writes only what the step wrote, whether Dynamo updates the group
    or rebuilds it (a ``pop`` in the step)."""
    from torch._dynamo.side_effects import SideEffects
    from torch._dynamo.source import AttrSource
    from torch._dynamo.variables import LazyVariableTracker, VariableTracker
    from torch._dynamo.variables.optimizer import OptimizerVariable

    original_set = OptimizerVariable._set_capturable
    original_codegen = SideEffects.codegen_update_mutated

    def _set_capturable(self: Any, tx: Any) -> None:
        original_set(self, tx)
        if self.source is None:
            return
        groups = LazyVariableTracker.realize_all(VariableTracker.build(
            tx, self.value.param_groups, AttrSource(self.source, "param_groups")))
        for group in groups.items:
            for key, value in group.items.items():
                if key.vt.is_python_constant() and key.vt.as_python_constant() == "capturable":
                    group._spmd_capturable = (key, group.original_items.get(key.vt), value)

    def codegen_update_mutated(self: Any, cg: Any, *args: Any, **kwargs: Any) -> Any:
        for var in self._get_modified_vars():
            entry = getattr(var, "_spmd_capturable", None)
            if entry is None:
                continue
            key, before, ours = entry
            if var.items.get(key) is not ours:  # the step wrote capturable itself
                continue
            if before is None:
                del var.items[key]
            else:
                var.items[key] = before
        return original_codegen(self, cg, *args, **kwargs)

    return [(OptimizerVariable, "_set_capturable", _set_capturable),
            (SideEffects, "codegen_update_mutated", codegen_update_mutated)]


def optimizer_attribute_stores() -> Patch:
    """An attribute stored on an optimizer inside the step (``self.k += 1`` in a custom
    ``step()``, an LR scheduler's ``_opt_called``) is replayed after each call.

    torch 2.13 builds an optimizer's variable as mutable but never registers it with the side
    effects it replays, so such stores were dropped: the graph baked the first call's value
    and later calls saw the attribute unchanged, training silently wrong. The first store
    registers the optimizer (later stores through another variable of the same optimizer go
    to the registered one)."""
    from torch._dynamo.side_effects import SideEffects
    from torch._dynamo.variables.optimizer import OptimizerVariable

    original = SideEffects.store_attr

    def store_attr(self: Any, item: Any, name: str, value: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(item, OptimizerVariable):
            tracked = self.id_to_variable.get(id(item.value))
            if tracked is None:
                self.id_to_variable[id(item.value)] = item
                self.keepalive.append(item.value)
            else:
                item = tracked
        return original(self, item, name, value, *args, **kwargs)

    return (SideEffects, "store_attr", store_attr)


def grad_stores_through_inplace_results() -> Patch:
    """``p.grad = None`` after ``p -= lr * p.grad`` (a hand-written SGD update in a loop over
    the parameters) is replayed.

    ``p -= x`` rebinds ``p`` to the in-place operator's result; torch 2.13 gives that result a
    variable of its own, without the parameter's source, and a ``.grad`` store on it is
    recorded there and never replayed (plain ``torch.compile`` too): the gradients stayed after the call and the next
    backward accumulated onto them (0.13 off DDP after four steps). A ``.grad`` store on such
    a variable goes to the variable of the graph input holding the same tensor."""
    from torch._dynamo.variables.builtin import SetAttrBuiltinVariable

    original = SetAttrBuiltinVariable._call_setattr

    def _call_setattr(self: Any, tx: Any, obj: Any, name_var: Any, val: Any) -> Any:
        if (
            obj.is_tensor() and getattr(obj, "source", None) is None
            and name_var.is_python_constant() and name_var.as_python_constant() in ("grad", "_grad")
        ):
            obj = _tracked_variable_of_same_tensor(tx, obj) or obj
        return original(self, tx, obj, name_var, val)

    return (SetAttrBuiltinVariable, "_call_setattr", _call_setattr)


def _tracked_variable_of_same_tensor(tx: Any, var: Any) -> Any:
    """The attribute-tracked variable of a graph input (it has a source) whose fake tensor is
    ``var``'s."""
    example = var.as_proxy().node.meta.get("example_value")
    if example is None:
        return None
    for tracked in tx.output.side_effects.id_to_variable.values():
        if tracked is var or not tracked.is_tensor() or getattr(tracked, "source", None) is None:
            continue
        if tracked.as_proxy().node.meta.get("example_value") is example:
            return tracked
    return None


def fresh_constants_for_tensor_attributes() -> list[Patch]:
    """``p.grad`` (None) and ``p.requires_grad`` read inside the step get a constant of their
    own.

    torch 2.13 answers both with its shared None/True/False constants and then sets that
    shared object's source to ``p.grad``/``p.requires_grad``: every later None or True of
    the process (in this frame, and in frames compiled after it, ours or not) was then rebuilt
    from that tensor attribute instead of being a constant. A step that calls ``zero_grad()``
    before the forward read ``.grad`` of a parameter reached through the optimizer, and the
    next model compiled in the process set its gradients from
    ``optim.param_groups[0]['params'][5].grad`` of the first (an IndexError, or a wrong
    tensor where the index exists)."""
    from torch._dynamo.variables import constant
    from torch._dynamo.variables.tensor import TensorVariable

    def fresh(original: Callable[..., Any]) -> Callable[..., Any]:
        def handler(self: Any, tx: Any) -> Any:
            result = original(self, tx)
            if any(result is c for c in _shared_constants(constant)):
                return constant.ConstantVariable(result.value)
            return result

        return handler

    return [
        (TensorVariable, name, fresh(TensorVariable.__dict__[name]))
        for name in ("method_attr_grad", "method_attr_requires_grad")
    ]


def _shared_constants(constant: Any) -> tuple[Any, ...]:
    return (constant.CONSTANT_VARIABLE_NONE, constant.CONSTANT_VARIABLE_TRUE,
            constant.CONSTANT_VARIABLE_FALSE)


def unsource_shared_constants() -> None:
    """Give torch's shared None/True/False constants back their (absent) source, should any
    other path of the frame have set one (see :func:`fresh_constants_for_tensor_attributes`)."""
    from torch._dynamo.variables import constant

    for c in _shared_constants(constant):
        if c.source is not None:
            log.warning('backend="spmd": torch\'s shared constant %r had the source %s after a '
                        "frame was compiled; reset", c.value, c.source.name)
            c.source = None
