"""The function make_fx traces: one call of the user's step on the lifted state.

:class:`StepFunction` is called by make_fx with the flat graph inputs (see
:mod:`spmd_backend.tracing.layout`) and runs four named stages:

1. :meth:`~StepFunction.wrap_state`: every input becomes a functional tensor; parameters get
   their existing ``.grad`` and gradient markers, the optimizer state and lifted
   hyper-parameters are laid out per parameter and slot.
2. :meth:`~StepFunction.run_user_step`: the user's function runs with the module
   reparametrized, the optimizer and GradScalers pointed at the lifted tensors, argument dicts
   replaced by read-tracking copies, and buffers passed through ``buffer_sync`` markers; the
   Python state it can write is snapshotted before and compared after
   (:mod:`spmd_backend.tracing.side_effects`: assignments replayed, other writes refused), and
   a buffer it rebinds is written into its lifted buffer
   (:mod:`spmd_backend.tracing.rebound_buffers`).
3. :meth:`~StepFunction.collect_outputs`: the user's return value, the optimizer state created
   or replaced by the step, the final gradients, the values of its replayed Python writes and
   (with a GradScaler) whether the optimizer step was skipped become the graph outputs
   (filling the output half of the layout).
4. :meth:`~StepFunction.write_back_inputs`: parameters, optimizer state and GradScaler state
   the step mutated get a ``copy_`` from their final value at the end of the graph (the
   optimizer region, which runs after every collective), so running the graph on the live
   tensors updates them in place. Mutated buffers (BatchNorm statistics) and arguments are
   graph outputs instead, copied into the live tensors only after the graph succeeded; final
   gradients are outputs anyway (``.grad`` is rebound), so a failing step never leaves them
   half-written.

Gradient markers (see :mod:`spmd_backend.tracing.markers`): a parameter without a ``.grad``
gets ``grad_ready`` after each accumulation (the data-parallel layer reduces the last one, so
several backward calls in one step communicate once); a parameter that already holds a ``.grad``
(accumulation across calls) gets ``grad_contribution`` on each new contribution *before* it is
accumulated, so only the new part is reduced and the earlier, already reduced, part is never
reduced again.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch.nn.utils import stateless

from spmd_backend.errors import SpmdTraceError, SpmdUsageError
from spmd_backend.tracing.binding import StepBinding
from spmd_backend.tracing.buffer_views import find_buffer_views, traced_view
from spmd_backend.tracing.dispatch import SYM_TYPES, TraceContext, TraceMode
from spmd_backend.tracing.free_values import mutable_objects
from spmd_backend.tracing.grad_scaler import SkipFlag, grad_scalers_swapped
from spmd_backend.tracing.hyperparams import HyperSlot
from spmd_backend.tracing.layout import InputGroups, StepLayout
from spmd_backend.tracing.markers import (
    BUFFER_SYNC,
    GRAD_CONTRIBUTION,
    GRAD_READY,
    check_dense_gradient,
)
from spmd_backend.tracing.optimizer_swap import optimizer_swapped
from spmd_backend.tracing.rebound_buffers import write_rebound_buffers
from spmd_backend.tracing.sharding import ShardedStep, ShardSpec
from spmd_backend.tracing.side_effects import Effects, Path, StateSnapshot
from spmd_backend.tracing.tracked import ReadRecorder, rebuild_tracked

log = logging.getLogger(__name__)

_CONST_TYPES = (bool, int, float, complex, str, type(None), torch.dtype, torch.device)


def to_functional(t: torch.Tensor) -> torch.Tensor:
    return FunctionalTensor.to_functional(t)


def from_functional(t: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, FunctionalTensor):
        return t
    torch._sync(t)
    return torch._from_functional_tensor(t.elem)


@dataclass
class LiftedState:
    """The functional stand-ins of one call's inputs (stage 1's result)."""

    params: list[torch.Tensor]
    buffers: list[torch.Tensor]
    state: list[torch.Tensor]
    hyper: dict[HyperSlot, torch.Tensor]
    grads: list[torch.Tensor]
    aux: list[torch.Tensor]
    args: list[torch.Tensor]
    #: per parameter index: the optimizer state the step starts from (lifted tensors, others as is)
    opt_state: dict[int, dict[str, Any]] = field(default_factory=dict)

    def groups(self) -> InputGroups[torch.Tensor]:
        return InputGroups(self.params, self.buffers, self.state, list(self.hyper.values()),
                           self.grads, self.aux, self.args)


def _is_inference_cache(leaf: Any) -> bool:
    """A transformers key/value cache (``DynamicCache``...): a by-product of the forward that
    training never needs."""
    return any(c.__name__ == "Cache" and "transformers" in c.__module__ for c in type(leaf).__mro__)


def _item_source(leaf: Any, items: dict[Any, torch.Tensor]) -> torch.Tensor | None:
    """The tensor whose ``.item()`` the step returned as ``leaf``, if it did."""
    if isinstance(leaf, SYM_TYPES):
        return items.get(leaf.node.expr)
    return None


def _output_leaf(leaf: Any, path: str) -> Any:
    """``leaf`` as the compiled step returns it: tensors and constants as they are, an inference
    cache dropped (None) with a warning, anything else refused with its path."""
    if isinstance(leaf, torch.Tensor) or isinstance(leaf, _CONST_TYPES):
        return leaf
    if _is_inference_cache(leaf):
        log.warning(
            "spmd_backend: the train step returns a %s at %s; the compiled step returns None "
            "there (an inference cache is not part of training; pass use_cache=False to the "
            "model to skip computing it)", type(leaf).__name__, path,
        )
        return None
    if isinstance(leaf, SYM_TYPES):
        raise SpmdUsageError(
            f"spmd_backend.compile: the train step returned a Python number computed from a "
            f"tensor's value at {path} (arithmetic on .item()); return the tensor (or the "
            ".item() itself) and compute the number after the compiled step"
        )
    raise SpmdUsageError(
        f"spmd_backend.compile: the train step returned a value of type "
        f"{type(leaf).__qualname__} at {path}; a compiled step may return tensors, None, "
        "Python numbers/strings, or (nested) tuples, lists, dicts and ModelOutputs of them"
    )


class StepFunction:
    """Callable traced by make_fx; see the module docstring."""

    def __init__(
        self,
        fn: Callable[..., Any],
        binding: StepBinding,
        layout: StepLayout,
        ctx: TraceContext,
        *,
        mark_buffers: bool,
        recorder: ReadRecorder,
        shard: ShardSpec | None = None,
    ) -> None:
        self.fn = fn
        self.binding = binding
        self.layout = layout
        self.ctx = ctx
        self.mark_buffers = mark_buffers
        self.recorder = recorder
        self.shard = shard
        self.saw_backward = False
        self.skip_flag = SkipFlag()
        self.effects = Effects()
        #: per buffer, the buffer whose memory holds it and the offset there (traced as a view
        #: of it), or None
        self.buffer_views = find_buffer_views(binding.buffers, binding.buffer_names,
                                              binding.params, binding.param_names)
        opt = binding.optimizer
        self.opt_state_before = {
            i: dict(opt.state[p]) for i, p in enumerate(binding.params)
            if opt is not None and p in opt.state
        }

    def __call__(self, *flat: torch.Tensor) -> list[torch.Tensor]:
        inputs = self.layout.split(flat)
        with FunctionalTensorMode(_allow_token_discovery=True), TraceMode(self.ctx):
            lifted = self.wrap_state(inputs)
            out, traced_state = self.run_user_step(lifted)
        results = self.collect_outputs(out, lifted, traced_state)
        results.extend(self.write_back_inputs(inputs, lifted.groups()))
        for effect, t in self.effects.tensors:  # Python writes replayed after each run
            self.layout.effect_outputs.append(effect)
            results.append(from_functional(t))
        self.layout.effect_consts = list(self.effects.consts)
        if self.skip_flag.value is not None:  # a GradScaler step: did it skip? (see commit)
            self.layout.skip_output = len(results)
            results.append(from_functional(self.skip_flag.value))
        return results

    # ------------------------------------------------------------------ stage 1
    def wrap_state(self, inputs: InputGroups[torch.Tensor]) -> LiftedState:
        binding, layout = self.binding, self.layout
        params = [
            to_functional(t).requires_grad_(p.requires_grad)
            for t, p in zip(inputs.params, binding.params)
        ]
        lifted = LiftedState(
            params=params,
            buffers=[to_functional(t) for t in inputs.buffers],
            state=[to_functional(t) for t in inputs.state],
            hyper={},
            grads=[to_functional(t) for t in inputs.grads],
            aux=[to_functional(t) for t in inputs.aux],
            # an argument that requires grad keeps requiring it (reentrant checkpoint needs an
            # input that does, or no parameter inside it gets a gradient)
            args=[
                to_functional(t).requires_grad_(_is_grad_leaf(binding.flat_args[j]))
                for t, j in zip(inputs.args, layout.arg_inputs)
            ],
        )
        for j, place in enumerate(self.buffer_views):
            if place is not None:
                lifted.buffers[j] = traced_view(lifted.buffers[place[0]], place[1],
                                                binding.buffers[j])
        for i, g in zip(layout.grad_inputs, lifted.grads):
            params[i].grad = g
        lifted.opt_state = {i: dict(v) for i, v in self.opt_state_before.items()}
        for (i, k), t in zip(layout.state_inputs, lifted.state):
            lifted.opt_state[i][k] = t
        for slot, t in zip(layout.hyper_inputs, inputs.hyper):
            ft = to_functional(t)
            # A grad-requiring tensor makes every torch optimizer use tensor arithmetic for the
            # hyper-parameter instead of `.item()`; the step runs under no_grad, so nothing is
            # recorded for it.
            ft.requires_grad_(True)
            lifted.hyper[slot] = ft
        return lifted

    # ------------------------------------------------------------------ stage 2
    def run_user_step(self, lifted: LiftedState) -> tuple[Any, Any]:
        binding = self.binding
        opt = binding.optimizer
        mapping: dict[str, torch.Tensor] = {}
        for names, fp in zip(binding.param_names, lifted.params):
            mapping.update(dict.fromkeys(names, fp))
        for names, fb in zip(binding.buffer_names, lifted.buffers):
            mapping.update(dict.fromkeys(names, fb))
        args, kwargs = self._arguments(lifted.args)
        sharded = None
        if self.shard is not None:
            names = {id(fp): n[0] for fp, n in zip(lifted.params, binding.param_names)}
            sharded = ShardedStep(self.shard, names)
        opt_cm = (
            optimizer_swapped(opt, lifted.params, binding.param_index(), lifted.opt_state,
                              lifted.hyper, self.ctx, self.recorder, binding.unfused_groups,
                              sharded)
            if opt is not None
            else contextlib.nullcontext(None)
        )
        outside = mutable_objects(self.fn, binding.modules)
        if opt is not None:
            outside.append((f"the optimizer {type(opt).__name__}", opt))
        snapshot = StateSnapshot(binding.modules, (args, kwargs), outside, self._arg_label)
        try:
            with self._gradient_markers(lifted), \
                    stateless._reparametrize_module(binding.module, mapping, tie_weights=False), \
                    grad_scalers_swapped(binding.aux_objects, self.layout.aux_inputs, lifted.aux,
                                         self.ctx, self.skip_flag), \
                    opt_cm as traced_state:
                if self.mark_buffers:  # a view's memory is its base's: broadcast with it
                    for names, fb, view in zip(binding.buffer_names, lifted.buffers,
                                               self.buffer_views):
                        if view is None:
                            fb.copy_(BUFFER_SYNC(fb, names[0]))
                out = self.fn(*args, **kwargs)
                rebound = write_rebound_buffers(binding.module, binding.buffer_names,
                                                lifted.buffers, self.buffer_views)
                if rebound:
                    log.info("spmd_backend: the step rebinds buffer(s) %s; their new values "
                             "are written back after each run", ", ".join(rebound))
        except BaseException:
            snapshot.restore()  # a failed trace leaves the Python state as it found it
            raise
        self.effects = snapshot.effects()
        return out, traced_state

    def _arg_label(self, path: Path) -> str:
        """An argument container's path as the user would write it (``args[2]['loss']``)."""
        if not path:
            return "arguments"
        text = "".join(f".{k}" if kind == "attr" else f"[{k!r}]" for kind, k in path[1:])
        return ("args" if path[0][1] == 0 else "kwargs") + text

    def _arguments(self, f_args: list[torch.Tensor]) -> tuple[tuple, dict]:
        binding = self.binding
        leaves = list(binding.flat_args)
        for j, fa in zip(self.layout.arg_inputs, f_args):
            leaves[j] = fa
        args, kwargs = pytree.tree_unflatten(leaves, binding.args_spec)
        if binding.tracked_leaves:
            paths = {j: binding.leaf_paths[j] for j in range(len(leaves))}
            args, kwargs = rebuild_tracked((args, kwargs), paths, self.recorder)
        return args, kwargs

    @contextlib.contextmanager
    def _gradient_markers(self, lifted: LiftedState) -> Iterator[None]:
        has_grad = set(self.layout.grad_inputs)
        handles = []
        for i, (names, fp) in enumerate(zip(self.binding.param_names, lifted.params)):
            if not fp.requires_grad:
                continue
            handles.extend(_user_tensor_hooks(self.binding.params[i], fp))
            if i in has_grad:
                def contribution(grads: tuple[torch.Tensor, ...], _name: str = names[0]
                                 ) -> tuple[torch.Tensor, ...]:
                    self.saw_backward = True
                    check_dense_gradient(grads[0], _name)
                    return (GRAD_CONTRIBUTION(grads[0], _name),)

                # A pre-hook of the parameter's AccumulateGrad node, not a tensor hook: it runs
                # only when a backward accumulates into .grad. A tensor hook also runs for
                # torch.autograd.grad(loss, param), whose result is this rank's own gradient
                # (a gradient penalty, an adaptive loss weight): marked, it came back reduced.
                # The node is kept alive here; the parameter holds it only weakly.
                accumulator = torch.autograd.graph.get_gradient_edge(fp).node
                handles.append(_KeepAlive(accumulator.register_prehook(contribution), accumulator))
            else:
                def ready(param: torch.Tensor, _name: str = names[0]) -> None:
                    self.saw_backward = True
                    check_dense_gradient(param.grad, _name)
                    param.grad = GRAD_READY(param.grad, _name)

                handles.append(fp.register_post_accumulate_grad_hook(ready))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    # ------------------------------------------------------------------ stage 3
    def collect_outputs(self, out: Any, lifted: LiftedState, traced_state: Any) -> list[torch.Tensor]:
        layout = self.layout
        leaves_with_path, layout.out_spec = pytree.tree_flatten_with_path(out)
        results: list[torch.Tensor] = []
        for path, leaf in leaves_with_path:
            read = _item_source(leaf, self.ctx.items)
            if read is not None:  # loss.item(): the graph returns the tensor, the number after it
                layout.out_leaves.append(("item", len(results)))
                results.append(from_functional(read))
                continue
            leaf = _output_leaf(leaf, "output" + pytree.keystr(path))
            if isinstance(leaf, torch.Tensor):
                layout.out_leaves.append(("tensor", len(results)))
                results.append(from_functional(leaf))
            else:
                layout.out_leaves.append(("const", leaf))
        layout.n_user_tensors = len(results)
        if self.binding.optimizer is not None:
            results.extend(self._state_outputs(lifted, traced_state))
        for i, fp in enumerate(lifted.params):
            if fp.grad is not None:
                layout.grad_outputs.append(i)
                results.append(from_functional(fp.grad))
        self._refuse_argument_gradients(lifted)
        return results

    def _refuse_argument_gradients(self, lifted: LiftedState) -> None:
        """An argument that requires grad and that the step's backward reached: eager would
        fill its ``.grad`` or, for a tensor made by an autograd graph outside the step (an
        encoder run before the call), backpropagate into that graph. The compiled step can do
        neither, so it says so instead of dropping those gradients."""
        paths = self.binding.arg_paths()
        for fa, j in zip(lifted.args, self.layout.arg_inputs):
            real = self.binding.flat_args[j]
            if fa.grad is None or not real.requires_grad:  # the step's own requires_grad_()
                continue
            made_by = (f"is the output of an autograd graph outside the step "
                       f"({type(real.grad_fn).__name__}): eager backward would backpropagate "
                       "into the modules that made it" if real.grad_fn is not None else
                       "requires grad: eager backward would fill its .grad")
            raise SpmdUsageError(
                f"spmd_backend.compile: the step's backward reaches argument {paths[j]}, which "
                f"{made_by}, and a compiled step returns only its own module's gradients. "
                "Detach it before the call (or create it with requires_grad=False), or move the "
                "code that makes it into the step (a tensor the step marks with requires_grad_() "
                "itself is fine). The model, the optimizer and the gradients are unchanged."
            )

    def _state_outputs(self, lifted: LiftedState, traced_state: Any) -> list[torch.Tensor]:
        layout = self.layout
        f_index = {id(fp): i for i, fp in enumerate(lifted.params)}
        inputs_by_slot = dict(zip(layout.state_inputs, lifted.state))
        results: list[torch.Tensor] = []
        for key_t, entries in traced_state.items():
            i = f_index.get(id(key_t))
            if i is None:
                raise SpmdTraceError(
                    "the optimizer created state for a tensor that is not one of the module's "
                    "parameters"
                )
            before = self.opt_state_before.get(i)
            if before is None or set(entries) - set(before):
                layout.creates_state = True
                layout.state_touched.append(i)
            for k, v in entries.items():
                if (i, k) in inputs_by_slot and v is inputs_by_slot[(i, k)]:
                    continue  # updated in place: handled by the copy_ epilogue
                if isinstance(v, torch.Tensor):
                    layout.state_outputs.append((i, k))
                    results.append(from_functional(v))
                elif before is None or k not in before or before[k] is not v:
                    layout.state_consts.append((i, k, v))
        return results

    # ------------------------------------------------------------------ stage 4
    def write_back_inputs(
        self, reals: InputGroups[torch.Tensor], funs: InputGroups[torch.Tensor]
    ) -> list[torch.Tensor]:
        """``copy_`` into parameter/state/GradScaler inputs; returns the new values of mutated
        buffers and arguments (outputs, committed after the graph succeeded)."""
        binding, layout = self.binding, self.layout
        groups = [
            ("params", reals.params, funs.params, "parameter", binding.param_names),
            ("buffers", reals.buffers, funs.buffers, "buffer", binding.buffer_names),
            ("state", reals.state, funs.state, "optimizer state", None),
            ("grads", reals.grads, funs.grads, "gradient", None),
            ("aux", reals.aux, funs.aux, "GradScaler state", None),
            ("args", reals.args, funs.args, "argument", None),
        ]
        outputs: list[torch.Tensor] = []
        for kind, real_list, fun_list, what, names in groups:
            for j, (real, f) in enumerate(zip(real_list, fun_list)):
                torch._sync(f)
                if torch._functionalize_has_metadata_mutation(f.elem):
                    label = names[j][0] if names else f"#{j}"
                    raise SpmdTraceError(
                        f"the train step changed the shape or strides of {what} {label} in "
                        "place; only data mutations of inputs are supported"
                    )
                if not torch._functionalize_has_data_mutation(f.elem) or kind == "grads":
                    continue
                if kind == "buffers" and self.buffer_views[j] is not None:
                    continue  # a view of another buffer: written back with its base
                if kind in ("buffers", "args"):
                    layout.mutated_outputs.append((kind, j))
                    outputs.append(from_functional(f))
                else:
                    real.copy_(from_functional(f))
        return outputs


def _is_grad_leaf(t: torch.Tensor) -> bool:
    """A tensor argument the step may differentiate with respect to, as eager would."""
    return t.requires_grad and t.is_floating_point()


@dataclass
class _KeepAlive:
    """A hook handle that also holds the autograd node it was registered on."""

    handle: Any
    node: Any

    def remove(self) -> None:
        self.handle.remove()


def _user_tensor_hooks(param: torch.Tensor, fp: torch.Tensor) -> list[Any]:
    """Register ``param``'s own gradient hooks (``register_hook``,
    ``register_post_accumulate_grad_hook``) on its stand-in ``fp``, in their order.

    Registered before the gradient markers, they run where they run under DDP: a tensor hook on
    this rank's gradient before it is accumulated and reduced, a post-accumulate hook on the
    accumulated local gradient before it is reduced. The key holds the hooks (a hook added or
    removed retraces), so the graph holds the hooks of the call that traced it. Hooks marked
    ``spmd_internal`` (the Dynamo door's gradient audit on a parameter both doors used) are
    not the user's and are skipped.
    """
    handles = [fp.register_hook(h) for h in (getattr(param, "_backward_hooks", None) or {}).values()
               if not getattr(h, "spmd_internal", False)]
    post = getattr(param, "_post_accumulate_grad_hooks", None) or {}
    handles.extend(fp.register_post_accumulate_grad_hook(h) for h in post.values()
                   if not getattr(h, "spmd_internal", False))
    return handles
