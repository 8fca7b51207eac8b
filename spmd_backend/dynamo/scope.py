"""Whole-step capture through Dynamo: scoped, version-gated adjustments of torch 2.13 internals.

Stock ``torch.compile`` of ``step(model, optim, batch)`` breaks the frame at ``loss.backward()``,
inside ``optimizer.step()`` (an explicit ``graph_break()``, ``_init_group`` run eagerly and then
refused for the pending gradients, ``disable()`` wrappers), at ``zero_grad`` and at an LR
scheduler's wrapper around ``step`` (see ../shared/TORCH_2_13_NOTES.md, "Dynamo whole-step
capture"). While Dynamo traces a frame *for the spmd backend*, :func:`whole_step_scope`:

* sets ``torch._dynamo.config.trace_autograd_ops`` (``loss.backward()`` becomes
  ``torch.autograd.grad`` in the graph) and ``allow_rnn`` (``nn.LSTM``/``GRU`` are traced
  instead of breaking the graph), with oneDNN off while the frame is traced and compiled (the
  recurrent layers' oneDNN kernels fail their backward when traced, see
  ``tracing.trace.compiling``), their inter-layer dropout kept (:mod:`.rnn_dropout`);
* makes the optimizer wrapper's ``graph_break()`` a no-op, inlines the ``disable()``-wrapped
  ``zero_grad`` and ``_init_group`` instead of skipping them, and traces ``_init_group`` rather
  than running it eagerly on the real (not yet updated) ``.grad``;
* traces through an LR scheduler's wrapper of ``optimizer.step`` (doing what it does: setting
  ``_opt_called``);
* lets ``return loss`` return a detached loss instead of restarting the frame (the compile door
  returns plain tensors too);
* turns a ``loss.backward()`` whose loss came from an earlier graph into a graph break (torch
  2.13 silently skips such a backward under ``trace_autograd_ops``: no gradients, no error);
* keeps parameters graph inputs when the frame reads ``optimizer.param_groups`` before the
  forward (``zero_grad()`` first), guarding instead which parameters and state the optimizer
  holds, and gives ``p.grad``/``p.requires_grad`` reads a constant of their own;
* replays attribute stores on an optimizer object (torch 2.13 drops them), and a ``.grad``
  store on a parameter rebound by an in-place operator (``p -= lr * p.grad; p.grad = None``,
  which torch 2.13 drops too);
* drops a logger call at a level the logger does not emit and makes a ``*_once`` call
  (transformers' ``warning_once`` in every model's ``loss_function``) while tracing, instead
  of breaking the graph;
* traces the fused optimizers (``_fused_adam``...) Dynamo otherwise skips, and
  ``GradScaler.scale`` (a scaled backward per micro-batch inside a loop), handing a fused
  kernel a dynamic ``lr`` (a scheduler's float) as a tensor so it stays a graph input
  (:mod:`spmd_backend.dynamo.float_inputs` does the same for the other uses);
* creates a fresh optimizer's state before tracing (:mod:`.fresh_state`);
* with ``options={"shard_optimizer": True}``: shards the state of the frame's optimizers before
  Dynamo reads it (one reached only through an attribute: when its ``_init_group`` is traced)
  and inlines each optimizer's update functional on this rank's shards (:mod:`.sharded_update`);
  a refused optimizer is raised by the backend (:func:`raise_refusal`).

The torch 2.13 faults among these live in :mod:`spmd_backend.dynamo.faults`.

Scoping: :func:`install` wraps ``torch._dynamo.convert_frame.compile_frame`` (the function
Dynamo calls for every frame, resume frames included) with a pass-through that enters the scope
only when the frame's backend is marked by :func:`mark_whole_step`. Dynamo holds its compile
lock there, so no other frame is traced meanwhile, and every patched method and config is
restored when the frame is done: a stock ``torch.compile(fn)`` or ``backend="eager"`` in the
same process behaves exactly as without this package (tests/test_dynamo_capture.py).
It also installs :mod:`spmd_backend.dynamo.eager_guard`, which keeps Dynamo from running a frame
of this backend eagerly, unsynchronized, without an error. On another torch version nothing is
installed and the backend runs in per-graph mode.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import itertools
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from spmd_backend.dynamo import eager_guard, faults, frame, fresh_state, rnn_dropout, sharded_update
from spmd_backend.dynamo.collective_grads import eager_collective_gradients
from spmd_backend.errors import SpmdUsageError
from spmd_backend.tracing import causal_mask
from spmd_backend.tracing.decompositions import aten_kernels_kept
from spmd_backend.tracing.hyperparams import warn_untrained_by_fused_kernel
from spmd_backend.tracing.sharding import ShardSpec

#: the torch versions whose internals this module adjusts
SUPPORTED = torch.__version__.startswith("2.13.")
_MARK = "_spmd_whole_step"
_state: dict[str, Any] = {"installed": False, "active": 0}


@dataclasses.dataclass
class _Sharding:
    """The sharded-optimizer setting of the frame being traced (``shard_optimizer`` option)."""

    spec: ShardSpec | None = None
    #: the data-parallel process group (the backend's ``process_group`` option)
    group: Any = None
    #: ``(optimizer, parameter)`` state entries created for this frame (undone on failure)
    created: list[tuple[Any, Any]] = dataclasses.field(default_factory=list)
    #: why the frame cannot be compiled (an optimizer that cannot be sharded, a module
    #: wrapped in DistributedDataParallel); the backend raises it: see :func:`raise_refusal`
    refused: Exception | None = None


_sharding = _Sharding()


def mark_whole_step(backend: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a backend callable: frames compiled for it are traced with the scope."""
    setattr(backend, _MARK, True)
    return backend


def _innermost(compiler_fn: Any) -> Any:
    from torch._dynamo.eval_frame import innermost_backend

    try:
        fn = innermost_backend(compiler_fn)
    except Exception:  # noqa: BLE001 - anything unexpected: not ours
        return None
    # a frame that uses a DistributedDataParallel module: Dynamo's DDPOptimizer wraps the
    # backend (its bound compile_fn); the frame is refused (frame.refuse_frame)
    wrapped = getattr(getattr(fn, "__self__", None), "backend_compile_fn", None)
    return _innermost(wrapped) if wrapped is not None else fn


def _is_whole_step_backend(compiler_fn: Any) -> bool:
    fn = _innermost(compiler_fn)
    fn = getattr(fn, "compiler_fn", fn)  # torch.compile's _TorchCompileWrapper
    fn = getattr(fn, "func", fn)  # functools.partial(backend, options=...)
    return bool(getattr(fn, _MARK, False))


def _backend_options(compiler_fn: Any) -> dict[str, Any] | None:
    """The ``options`` the backend will be called with (``torch.compile(..., options=...)`` or
    ``functools.partial(backend, options=...)``)."""
    fn = _innermost(compiler_fn)
    kwargs = getattr(fn, "kwargs", None)  # _TorchCompileWrapper
    if isinstance(kwargs, dict):
        return kwargs.get("options")
    keywords = getattr(fn, "keywords", None)  # functools.partial
    return keywords.get("options") if isinstance(keywords, dict) else None


def _original(fn: Any) -> Any:
    """Undo ``torch._dynamo.disable`` and ``torch._disable_dynamo`` wrappers."""
    disable_inner = torch._disable_dynamo(lambda: None).__code__
    for _ in range(8):
        if getattr(fn, "_torchdynamo_orig_callable", None) is not None:
            fn = fn._torchdynamo_orig_callable
        elif getattr(fn, "__code__", None) is disable_inner and hasattr(fn, "__wrapped__"):
            fn = fn.__wrapped__
        else:
            break
    return fn


def _optimizer_functions() -> set[Any]:
    """The disabled optimizer functions the scope lets Dynamo trace."""
    out = {_original(torch.optim.Optimizer.zero_grad)}
    for cls in vars(torch.optim).values():
        module = sys.modules.get(getattr(cls, "__module__", ""))
        fused = getattr(module, f"_fused_{module.__name__.rsplit('.', 1)[-1]}", None) if module else None
        if fused is not None:  # Dynamo skips fused optimizers; the pipeline lowers them
            out.add(_original(fused))
        if inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer):
            init_group = cls.__dict__.get("_init_group")
            if init_group is not None:
                out.add(_original(init_group))
    return out


def _example(grapharg: Any) -> Any:
    try:
        return grapharg.example
    except Exception:  # noqa: BLE001 - a released example is not a live activation
        return None


def _scheduler_wrapper_code() -> Any:
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    return opt.step.__code__


Patch = faults.Patch


def _inline_disabled(traceable: set[Any]) -> Patch:
    """``zero_grad`` is wrapped by ``torch._disable_dynamo``: inline the original instead."""
    from torch._dynamo.symbolic_convert import InstructionTranslatorBase
    from torch._dynamo.variables.base import VariableTracker
    from torch._dynamo.variables.functions import UserFunctionVariable

    disable_inner = torch._disable_dynamo(lambda: None).__code__
    original = InstructionTranslatorBase.inline_user_function_return

    def inline_user_function_return(self: Any, fn: Any, args: Any, kwargs: Any, *a: Any, **k: Any) -> Any:
        if isinstance(fn, UserFunctionVariable) and causal_mask.ORIGINAL is not None \
                and fn.get_function() is causal_mask.ORIGINAL:
            # torch's transformer layers: no decision on the mask's values (tracing/causal_mask)
            fn = VariableTracker.build(self, causal_mask.hint_from_argument)
        if isinstance(fn, UserFunctionVariable) and fn.get_code() is disable_inner:
            target = _original(fn.get_function())
            if target in traceable:
                fn = VariableTracker.build(self, target)
        spec = _sharding.spec  # none after a refusal: traced unsharded, the backend raises it
        if spec is not None and _sharding.refused is None \
                and isinstance(fn, UserFunctionVariable) and len(args) >= 2 \
                and fn.get_function() in sharded_update.FUNCTIONALS \
                and self.f_code is not sharded_update.sharded_update.__code__:
            fqns = sharded_update.param_fqns(args[0], sharded_update.FUNCTIONALS[fn.get_function()])
            extra = [fn, *(VariableTracker.build(self, v) for v in (spec.rank, spec.world, fqns))]
            fn, args = VariableTracker.build(self, sharded_update.sharded_update), [*extra, *args]
        return original(self, fn, args, kwargs, *a, **k)

    return (InstructionTranslatorBase, "inline_user_function_return", inline_user_function_return)


def _skipped_calls(traceable: set[Any]) -> Patch:
    """Trace a scheduler's ``step`` wrapper, drop the optimizer's ``graph_break()``, inline
    ``disable()``-wrapped optimizer functions."""
    from torch._dynamo.variables.base import VariableTracker
    from torch._dynamo.variables.constant import ConstantVariable
    from torch._dynamo.variables.functions import SkipFunctionVariable
    from torch.optim import optimizer as optimizer_module

    use_grad_code = optimizer_module._use_grad_for_differentiable(lambda self: None).__code__
    scheduler_code = _scheduler_wrapper_code()
    original = SkipFunctionVariable.call_function

    def call_function(self: Any, tx: Any, args: Any, kwargs: Any) -> Any:
        value = self.value
        if getattr(value, "__code__", None) is scheduler_code and self.source is not None:
            # an LR scheduler's wrapper around optimizer.step: do what it does, traced
            cells = dict(zip(value.__code__.co_freevars, value.__closure__ or ()))
            opt = VariableTracker.build(tx, cells["opt_ref"].cell_contents(), self.source.base)
            tx.output.side_effects.store_attr(opt, "_opt_called", ConstantVariable.create(True))
            step = VariableTracker.build(tx, value.__wrapped__)
            return tx.inline_user_function_return(step, [opt, *args], kwargs)
        if value is torch._dynamo.graph_break and tx.f_code is use_grad_code:
            return ConstantVariable.create(None)
        target = _original(value)
        if target is not value and target in traceable:
            return tx.inline_user_function_return(VariableTracker.build(tx, target), list(args), kwargs)
        return original(self, tx, args, kwargs)

    return (SkipFunctionVariable, "call_function", call_function)


def _init_group_traced() -> Patch:
    """Trace ``_init_group``: run eagerly it would read the real, not yet updated, ``.grad``."""
    from torch._dynamo.variables.base import VariableTracker
    from torch._dynamo.variables.optimizer import OptimizerVariable

    original = OptimizerVariable.call_method

    def call_method(self: Any, tx: Any, name: str, args: Any, kwargs: Any) -> Any:
        if name == "_init_group":
            _prepare_sharding([self.value])  # with sharding on: one the frame hook did not see
            warn_untrained_by_fused_kernel(self.value)
            target = VariableTracker.build(tx, _original(type(self.value)._init_group))
            return tx.inline_user_function_return(target, [self, *args], kwargs)
        return original(self, tx, name, args, kwargs)

    return (OptimizerVariable, "call_method", call_method)


def _fused_lr_as_tensor() -> Patch:
    """A fused kernel's ``lr`` that Dynamo made dynamic (a scheduler's float) as a 0-dim
    tensor, float64 on the CPU and float32 elsewhere (what the kernels read; the compile door
    lifts it the same way, tracing/hyperparams.py). The kernel's ``float lr`` argument made
    Dynamo specialize the value: a new graph per value. :mod:`spmd_backend.dynamo.float_inputs`
    then keeps the tensor a graph input."""
    from torch._dynamo.variables.base import VariableTracker
    from torch._dynamo.variables.tensor import SymNodeVariable
    from torch._dynamo.variables.torch import TorchInGraphFunctionVariable

    kernels = {torch._fused_adam_, torch._fused_adamw_, torch._fused_sgd_, torch._fused_adagrad_}
    original = TorchInGraphFunctionVariable.call_function

    def call_function(self: Any, tx: Any, args: Any, kwargs: Any) -> Any:
        lr = kwargs.get("lr")
        if self.value in kernels and isinstance(lr, SymNodeVariable) and lr.python_type() is float:
            params = getattr(args[0], "items", None) if args else None
            device = getattr(params[0], "device", None) if params else None
            dtype = torch.float64 if device is None or device.type == "cpu" else torch.float32
            options = {"dtype": VariableTracker.build(tx, dtype)}
            if device is not None:
                options["device"] = VariableTracker.build(tx, device)
            tensor = VariableTracker.build(tx, torch.scalar_tensor).call_function(tx, [lr], options)
            kwargs = {**kwargs, "lr": tensor}
        return original(self, tx, args, kwargs)

    return (TorchInGraphFunctionVariable, "call_function", call_function)


#: logger methods -> the level they emit at
_LOG_LEVELS = {
    "debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
    "warn": logging.WARNING, "error": logging.ERROR, "exception": logging.ERROR,
    "critical": logging.CRITICAL, "info_once": logging.INFO, "warning_once": logging.WARNING,
}


def _logger_calls_traced() -> Patch:
    """A ``logging.Logger`` call in the step broke the graph (Dynamo traces none): every
    transformers model's ``loss_function`` calls ``logger.warning_once`` when
    ``config.loss_type`` is unset, so the standard ``model(ids, labels=ids).loss`` step fell back
    to per-graph mode. A call at a level the logger does not emit is dropped (eager prints
    nothing either); a ``*_once`` call with constant arguments is made while tracing (it prints
    once, as eager's first call does). Any other logger call still breaks the graph."""
    from torch._dynamo.variables.constant import ConstantVariable
    from torch._dynamo.variables.misc import LoggingLoggerVariable

    original = LoggingLoggerVariable.call_method

    def call_method(self: Any, tx: Any, name: str, args: Any, kwargs: Any) -> Any:
        level = _LOG_LEVELS.get(name)
        logger = self.value
        if level is not None and not tx.export and isinstance(logger, logging.Logger):
            if not logger.isEnabledFor(level):
                return ConstantVariable.create(None)
            values = [*args, *kwargs.values()]
            if name.endswith("_once") and all(v.is_python_constant() for v in values):
                getattr(logger, name)(*(a.as_python_constant() for a in args),
                                      **{k: v.as_python_constant() for k, v in kwargs.items()})
                return ConstantVariable.create(None)
        return original(self, tx, name, args, kwargs)

    return (LoggingLoggerVariable, "call_method", call_method)


def _return_loss_detached() -> Patch:
    """``return loss`` after ``loss.backward()``: return it detached, not restart the frame."""
    from torch._dynamo.output_graph import OutputGraph, collect_reachable_grad_fns
    from torch._dynamo.variables.tensor import TensorVariable

    original = OutputGraph._validate_outputs_safe_for_autograd_nodes

    def validate(self: Any, rv: list[Any], tx: Any) -> None:
        consumed = self.autograd_grad_consumed_grad_fns
        for i, var in enumerate(rv):
            if consumed and isinstance(var, TensorVariable) and var.requires_grad:
                fake = var.as_proxy().node.meta.get("example_value")
                if fake is not None and fake.grad_fn is not None and (
                    collect_reachable_grad_fns([(fake, None)]) & consumed
                ):
                    rv[i] = var.call_method(tx, "detach", [], {})
        return original(self, rv, tx)

    return (OutputGraph, "_validate_outputs_safe_for_autograd_nodes", validate)


def _backward_of_upstream_loss() -> Patch:
    """A graph break instead of torch 2.13's silent loss of gradients when the loss depends on
    an earlier graph's (or an eager region's) output."""
    from torch._dynamo.exc import unimplemented
    from torch._dynamo.variables.tensor import TensorVariable

    original = TensorVariable.method_backward

    def method_backward(self: Any, tx: Any, *args: Any, **kwargs: Any) -> Any:
        inputs = kwargs.get("inputs", args[3] if len(args) > 3 else None)
        if inputs is None and self.has_grad_fn:
            leaves = self._collect_backward_inputs(itertools.chain(
                tx.output.leaf_var_creation_order, tx.output.input_source_to_var.values()
            ))
            # torch 2.13 differentiates only w.r.t. this frame's leaves
            upstream = [
                ex for ex in (_example(a) for a in tx.output.graphargs)
                if isinstance(ex, torch.Tensor) and ex.requires_grad and ex.grad_fn is not None
            ]
            if not leaves or upstream:
                unimplemented(
                    gb_type="spmd_backend: backward of a loss computed partly outside this graph",
                    context=str(self),
                    explanation="the loss depends on tensors produced before a graph break; "
                    "backward runs eagerly through every graph instead",
                    hints=["Remove the graph break inside the model (torch._dynamo.explain)."],
                )
        return original(self, tx, *args, **kwargs)

    return (TensorVariable, "method_backward", method_backward)


def _grad_scaler_scale_traced() -> Patch:
    """Trace ``GradScaler.scale``: Dynamo skips torch/amp's files, and a skipped call inside a
    loop (``scaler.scale(loss).backward()`` per micro-batch) cannot break the graph there, so
    Dynamo ran the whole step eagerly and the gradient audit refused it. ``scale`` is tensor
    math on the scaler's ``_scale`` (created on first use); ``step`` and ``update`` stay as
    they were (``step`` reads ``found_inf`` on the host: a graph break outside the loop)."""
    from torch._dynamo import trace_rules
    from torch._dynamo.symbolic_convert import InliningInstructionTranslator
    from torch.amp.grad_scaler import GradScaler

    codes = {GradScaler.scale.__code__, GradScaler._lazy_init_scale_growth_tracker.__code__}
    original = InliningInstructionTranslator.__dict__["check_inlineable"].__func__

    def check_inlineable(func: Any) -> Any:
        try:
            code = func.get_function().__code__
        except Exception:  # noqa: BLE001 - a variable without a Python function
            code = None
        if code in codes:
            return trace_rules.SkipResult(False, "spmd_backend traces GradScaler.scale")
        return original(func)

    return (InliningInstructionTranslator, "check_inlineable", staticmethod(check_inlineable))


def _patches() -> list[Patch]:
    """(owner, attribute, replacement) for every adjustment of the scope."""
    traceable = _optimizer_functions()
    return [
        _inline_disabled(traceable), _skipped_calls(traceable), _init_group_traced(),
        _fused_lr_as_tensor(), _logger_calls_traced(), _return_loss_detached(),
        _backward_of_upstream_loss(), _grad_scaler_scale_traced(),
        *faults.fault_patches(), *filter(None, [rnn_dropout.patch()]),
    ]


@contextlib.contextmanager
def whole_step_scope() -> Iterator[None]:
    """The adjustments, active while one frame is traced and compiled for our backend."""
    if _state["active"]:
        yield
        return
    patches = _patches()
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]
    _state["active"] += 1
    try:
        with torch._dynamo.config.patch(trace_autograd_ops=True, allow_rnn=True), \
                torch.backends.mkldnn.flags(enabled=False), eager_collective_gradients(), \
                aten_kernels_kept():
            for owner, name, fn in patches:
                setattr(owner, name, fn)
            yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
        _state["active"] -= 1
        faults.unsource_shared_constants()


def _prepare_sharding(optimizers: list[Any]) -> None:
    """With sharding on: create a fresh optimizer's state and shard it before it is traced."""
    if optimizers and _sharding.spec is not None:  # both idempotent
        _sharding.created.extend(fresh_state.create_fresh_state(optimizers, settings_dependent=True))
        try:
            sharded_update.prepare(optimizers, _sharding.spec, _sharding.group)
        except SpmdUsageError as e:  # raised by the backend, like its other errors
            _sharding.refused = _sharding.refused or e


def raise_refusal() -> None:
    """Raise the reason the frame being compiled is refused (a DDP-wrapped module, an
    optimizer that cannot be sharded), if any
    (called by the backend: an error raised while Dynamo traces would reach the user as an
    internal Dynamo error)."""
    if _sharding.refused is not None:
        raise _sharding.refused


def install() -> bool:
    """Install the pass-through frame hook once; False (nothing installed) off torch 2.13."""
    if not SUPPORTED:
        return False
    if _state["installed"]:
        return True
    import torch._dynamo.convert_frame as convert_frame

    original = convert_frame.compile_frame

    @functools.wraps(original)
    def compile_frame(code: Any, globals: Any, locals: Any, builtins: Any, closure: Any,
                      compiler_fn: Any, *args: Any, **kwargs: Any) -> Any:
        if not _is_whole_step_backend(compiler_fn):
            return original(code, globals, locals, builtins, closure, compiler_fn, *args, **kwargs)
        global _sharding
        options = _backend_options(compiler_fn)
        outer = _sharding  # a frame compiled while another is (not expected)
        values = frame.frame_values(code, locals, globals, closure)
        with whole_step_scope(), frame.parameter_names(values):
            faults.OPTIMIZER_PARAMS.clear()  # this frame's: filled while it is traced
            optimizers = fresh_state.optimizers_of_frame(code, locals, globals, closure)
            _sharding = _Sharding(*(sharded_update.spec_for(options) or (None, None)))
            frame.refuse_frame(values, compiler_fn)
            _sharding.created = fresh_state.create_fresh_state(optimizers)
            try:
                _prepare_sharding(optimizers)
                compiled = original(code, globals, locals, builtins, closure, compiler_fn, *args, **kwargs)
                if _sharding.spec is not None:  # only sharding creates state made from settings
                    fresh_state.keep_fresh(_sharding.created, _sharding.spec)
                return compiled
            except BaseException:
                fresh_state.remove_state(_sharding.created)
                raise
            finally:
                _sharding = outer

    convert_frame.compile_frame = compile_frame
    eager_guard.install(_is_whole_step_backend, _backend_options)
    _state["installed"] = True
    return True
