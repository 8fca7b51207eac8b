"""No step of ``backend="spmd"`` runs eagerly, unsynchronized, without an error.

``backend="spmd"`` is where a step's gradients are reduced: a frame Dynamo runs eagerly, without
calling the backend, computes each rank's gradients alone. Dynamo does so silently when

* it is disabled when the step is decorated (``torch.compile(..., disable=True)``,
  ``TORCHDYNAMO_DISABLE=1``): ``torch.compile`` returns the function itself;
* it is disabled when the step is called (``torch._dynamo.config.disable``), or a torch dispatch
  mode is active (``FlopCounterMode``, ``DebugMode``): it skips every frame;
* a compile stance says so (``torch.compiler.set_stance``): ``force_eager`` runs every call
  eagerly, ``eager_then_compile``/``aot_eager_then_compile`` the first, ``eager_on_recompile``
  every call that would recompile;
* it gives up on a frame while compiling it (a graph break it cannot resume from, its recompile
  limit, any error under ``torch._dynamo.config.suppress_errors``): the wrapper of ``_compile``
  refuses a frame at the recompile limit that reaches watched parameters before it runs
  (:func:`spmd_backend.dynamo.audit.refuse_eager_fallback`), or any trainable parameter on a
  group of several ranks (a new model: past the limit Dynamo runs the frame eagerly without
  calling any hook again, :func:`_refuse_past_the_limit`), and otherwise has the gradient
  audit watch the trainable parameters the frame reaches
  (:func:`spmd_backend.dynamo.audit.watch_skipped_frame`), so an eager gradient raises in
  ``backward()`` (before 2026-11-26: unsynchronized, silently, when no graph had seen them),
  or, where the configuration allows (:func:`spmd_backend.dynamo.eager_grads.for_mode`), is
  reduced at the end of ``backward()`` as DDP reduces it (since 2026-11-27; warned once per
  frame). A frame it compiles in pieces (graph breaks it resumes from) runs eagerly what lies
  between them, torch's own modules and disabled functions included: where the configuration
  allows, the parameters such a frame reaches are adopted the same way when it compiles (since
  2026-11-28; logged once per frame), else their eager gradients raise in ``backward()``.

Until 2026-11-26 the first three trained each rank on its own data with no error (0.08 off DDP
after 5 Adam steps). :func:`install` now wraps ``torch._dynamo.optimize`` (for the first),
Dynamo's per-frame skip (for the second) and its choice of callback under a stance (for the
third), all pass-through for other backends. The stances that run some calls eagerly to save
compiles are not applied to this backend's frames (they compile as by default; warned once);
any other such call raises :class:`~spmd_backend.errors.SpmdUsageError` before anything of it
runs when the data-parallel group has more than one rank and the frame reaches a trainable
parameter with gradients enabled (an evaluation under ``no_grad`` and a one-rank run go on
eagerly, which is exact there).
A module given to a disabled ``torch.compile`` is returned as is, so it is checked when it is
decorated (refused, or a warning before the process group exists).

Requires torch 2.13 internals: ``torch._dynamo.optimize`` returning ``_NullDecorator`` when
disabled, ``CatchErrorsWrapper._handle_skip`` with the skip reasons of ``convert_frame``,
``eval_frame._callback_from_stance`` (looked up by name at each call), ``convert_frame._compile``
and its arguments.
"""

from __future__ import annotations

import functools
import inspect
import logging
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

from spmd_backend.dynamo import audit, frame, given_up
from spmd_backend.errors import SpmdError, SpmdUsageError

log = logging.getLogger(__name__)

#: the reasons Dynamo gives in ``CatchErrorsWrapper`` for skipping a frame it was asked to compile
#: that this module refuses (other skips: a frame of a skipped file, a resumed generator), with
#: what the error says of each and what to do
_REFUSED_SKIPS = {
    "Dynamo tracing is disabled": (
        "torch._dynamo.config.disable is set",
        "unset it for the step"),
    "non-infra torch dispatch mode present": (
        "a torch dispatch mode is active (FlopCounterMode, DebugMode, ...), under which Dynamo "
        "compiles nothing",
        "call the step outside the mode, or compile it with spmd_backend.compile, whose step runs "
        "under such a mode"),
}
_DISABLED = ("torch.compile(disable=True) or TORCHDYNAMO_DISABLE=1",
             "compile the step with Dynamo enabled")


def group_size(options: dict[str, Any] | None) -> int:
    """The number of ranks the backend would reduce over with ``options``; 1 without a process
    group or with options the backend refuses (it raises its own error for those)."""
    from spmd_backend.pipeline import PipelineConfig

    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return 1
    try:
        group = PipelineConfig.from_options(options, door="dynamo").parallel.process_group()
    except SpmdError:
        return 1
    return int(torch.distributed.get_world_size(group))


def trained_parameter(values: Iterable[object]) -> str | None:
    """The name of a parameter that requires grad among the modules and optimizers in
    ``values`` (:func:`spmd_backend.dynamo.frame.trainable_parameters`), when gradients are
    enabled; else None."""
    if not torch.is_grad_enabled():
        return None
    for owner, name, _ in frame.trainable_parameters(values):
        if isinstance(owner, torch.optim.Optimizer):
            return f"a parameter of {type(owner).__name__}"
        return f"{type(owner).__name__}.{name}" if name else type(owner).__name__
    return None


def _eager_refusal(values: Iterable[object], options: dict[str, Any] | None, what: str,
                   why: tuple[str, str]) -> SpmdUsageError | None:
    """The error for running ``what`` eagerly (``why``: the cause, the way out) when ``values``
    reach a trainable parameter with gradients enabled on a group of several ranks, else None."""
    parameter = trained_parameter(values)
    if parameter is None:
        return None
    world = group_size(options)
    if world <= 1:
        return None
    return SpmdUsageError(
        f'backend="spmd": {what} would run eagerly ({why[0]}): backend="spmd" is what reduces '
        f"the gradients across the {world} ranks, so each rank would train {parameter} on its own "
        f"gradients. It is refused before it runs: {why[1]} (to debug eagerly, wrap the model in "
        "DistributedDataParallel instead)"
    )


def _refuse_disabled_call(fn: Callable[..., Any], options: dict[str, Any] | None) -> Callable[..., Any]:
    """``fn`` (a step ``torch.compile`` returned as is) checked at each call."""

    @functools.wraps(fn)
    def step(*args: Any, **kwargs: Any) -> Any:
        refused = _eager_refusal([*args, *kwargs.values()], options,
                                 f"the step {getattr(fn, '__qualname__', fn)!r}", _DISABLED)
        if refused is not None:
            raise refused
        return fn(*args, **kwargs)

    return step


def _wrap_optimize(original: Callable[..., Any], ours: Callable[[Any], bool],
                   options_of: Callable[[Any], dict[str, Any] | None]) -> Callable[..., Any]:
    from torch._dynamo.eval_frame import _NullDecorator

    @functools.wraps(original)
    def optimize(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        backend = kwargs.get("backend", args[0] if args else None)
        if not isinstance(result, _NullDecorator) or backend is None or not ours(backend):
            return result
        options = options_of(backend)

        def decorate(fn: Any) -> Any:
            if isinstance(fn, torch.nn.Module):  # returned as is: checked now
                refused = _eager_refusal([fn], options, f"the module {type(fn).__name__}", _DISABLED)
                if refused is not None:
                    raise refused
                if not torch.distributed.is_initialized():
                    warnings.warn(
                        f'torch.compile(..., backend="spmd") of a {type(fn).__name__} with Dynamo '
                        f"disabled ({_DISABLED[0]}) returns the module as is: its gradients are "
                        "not reduced across ranks", stacklevel=3)
                return fn
            return _refuse_disabled_call(fn, options)

        return decorate

    return optimize


def _wrap_handle_skip(original: Callable[..., Any], ours: Callable[[Any], bool],
                      options_of: Callable[[Any], dict[str, Any] | None]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _handle_skip(self: Any, result: Any, dynamo_frame: Any) -> Any:
        reason = getattr(result, "skip_reason", None)
        why = next((w for r, w in _REFUSED_SKIPS.items() if reason and reason.startswith(r)), None)
        backend = getattr(self, "_torchdynamo_orig_backend", None)
        if why is not None and backend is not None and ours(backend):
            refused = _eager_refusal(_values_of(dynamo_frame), options_of(backend),
                                     audit.where(dynamo_frame.f_code), why)
            if refused is not None:
                raise refused
        return given_up.this_call_only(original(self, result, dynamo_frame), dynamo_frame.f_code)

    return _handle_skip


def _wrap_catch_errors_call(original: Callable[..., Any], ours: Callable[[Any], bool],
                            options_of: Callable[[Any], dict[str, Any] | None]) -> Callable[..., Any]:
    """Dynamo's frame callback, answering a later call of a frame it gave up on
    (:mod:`spmd_backend.dynamo.given_up`) first: a new model's parameters are handed to the
    gradient audit (adopted where per-graph mode reduces eager gradients) and the frame runs
    eagerly, this call only, without Dynamo's per-call work (about 0.05 ms)."""

    @functools.wraps(original)
    def __call__(self: Any, dynamo_frame: Any, cache_entry: Any, frame_state: Any) -> Any:
        gave_up = given_up.given_up(frame_state)
        backend = getattr(self, "_torchdynamo_orig_backend", None)
        if gave_up is None or backend is None or not ours(backend):
            return original(self, dynamo_frame, cache_entry, frame_state)
        if torch.is_grad_enabled():
            values = _values_of(dynamo_frame)
            found = [p for _, _, p in frame.trainable_parameters(values)]
            if gave_up.unseen(found):  # a new model, a new head: adopted as Dynamo would
                from torch._dynamo.convert_frame import _disable_current_modes, compile_lock

                with compile_lock, _disable_current_modes():  # outside the user's modes
                    audit.watch_skipped_frame(values, dynamo_frame.f_code, gave_up.reason,
                                              _eager_gradients(options_of(backend)))
                gave_up.handed_over(found)
        return given_up.skip_this_call(gave_up.reason)

    return __call__


def _runs_eagerly_after(error: Exception, arguments: dict[str, Any]) -> bool:
    """Whether Dynamo answers ``error``, raised by its ``_compile`` (called with ``arguments``),
    by running the frame eagerly instead of raising it: a graph break it cannot resume from
    (``Unsupported``, ``UserError``), or any error under ``torch._dynamo.config.suppress_errors``
    (a refusal of this backend included); never with ``fullgraph=True``."""
    from torch._dynamo import exc

    box = arguments.get("convert_frame_box")
    if arguments.get("one_graph") or getattr(box, "error_on_graph_break", False):
        return False
    if isinstance(error, (exc.UncapturedHigherOrderOpError, exc.ResumePrologueTracingError)):
        return False
    return isinstance(error, (exc.Unsupported, exc.UserError)) or bool(torch._dynamo.config.suppress_errors)


def _eager_gradients(options: dict[str, Any] | None) -> Callable[..., None] | None:
    """Where a skipped frame's parameters go to have their eager gradients reduced
    (:mod:`spmd_backend.dynamo.eager_grads`), for the backend configured by ``options``; None
    where they stay refused."""
    from spmd_backend.dynamo import eager_grads
    from spmd_backend.pipeline import PipelineConfig

    try:
        registry = eager_grads.for_mode(PipelineConfig.from_options(options, door="dynamo").parallel)
    except SpmdError:
        return None
    return None if registry is None else registry.adopt_frame


def _refuse_past_the_limit(values: list[Any], code: Any, limit: str,
                           options: dict[str, Any] | None) -> SpmdUsageError | None:
    """The error for a frame at Dynamo's recompile ``limit`` that reaches a trainable parameter
    the audit does not watch yet (a new model: the next fold of a cross-validation, a restart),
    on a group of several ranks.

    Past the limit Dynamo runs the frame eagerly for every call no compiled graph serves, and
    from then on without calling any hook: adopting this model's gradients would have covered
    this call only, and every later model trained unsynchronized (before 2026-11-28: folds 10
    and 11 of a k-fold loop 0.05 off DDP, the ranks' replicas apart, silently)."""
    value = getattr(torch._dynamo.config, limit, "?")
    return _eager_refusal(
        values, options, audit.where(code),
        (f"Dynamo compiled it up to its {limit} ({value}) and now runs it eagerly, without "
         "calling the backend, for every call no compiled graph serves: each new model, "
         "optimizer or parameter recompiles",
         "call torch._dynamo.reset() before training a new model and optimizer (a new fold, a "
         "restart), or raise torch._dynamo.config.recompile_limit; TORCH_LOGS=recompiles says "
         "why it recompiled"))


def _refusing_eager_fallback(original: Callable[..., Any], ours: Callable[[Any], bool],
                             options_of: Callable[[Any], dict[str, Any] | None]) -> Callable[..., Any]:
    """Wrap Dynamo's ``_compile`` so that a frame compiled for this backend that reached
    Dynamo's recompile limit, and would therefore run eagerly, is refused before it runs when
    it reaches a trained module (:func:`spmd_backend.dynamo.audit.refuse_eager_fallback`); when
    Dynamo gives up on such a frame while compiling it (a soft failure it answers by running the
    frame eagerly), the trainable parameters the frame reaches are watched by the gradient audit
    (:func:`spmd_backend.dynamo.audit.watch_skipped_frame`)."""
    import torch._dynamo.convert_frame as convert_frame

    signature = inspect.signature(original)

    @functools.wraps(original)
    def _compile(*args: Any, **kwargs: Any) -> Any:
        from torch._dynamo import exc
        from torch._dynamo.utils import counters

        a = signature.bind(*args, **kwargs).arguments
        compiler_fn = a.get("compiler_fn")
        if compiler_fn is None or not ours(compiler_fn):
            return original(*args, **kwargs)
        values = frame.frame_values(a["code"], a["locals"], a["globals"], a["closure"])
        exceeded, limit = convert_frame.exceeds_recompile_limit(a["cache_size"], a["compile_id"])
        if exceeded:
            refused = audit.refuse_eager_fallback(
                values, a["code"], limit, getattr(torch._dynamo.config, limit, "?")) \
                or _refuse_past_the_limit(values, a["code"], limit, options_of(compiler_fn))
            if refused is not None:
                raise refused
        breaks = dict(counters["graph_break"])
        try:
            result = original(*args, **kwargs)
        except Exception as e:
            if _runs_eagerly_after(e, a):
                root = getattr(e, "inner_exception", None) or e  # BackendCompilerFailed: ours
                first = next((line.strip() for line in str(root).splitlines() if line.strip()), "")
                reason = f"{type(root).__name__}: {first[:300]}"
                if not isinstance(e, (exc.Unsupported, exc.UserError)):
                    reason += " (an error torch._dynamo.config.suppress_errors turns into an eager run)"
                adopt = _eager_gradients(options_of(compiler_fn))
                count = audit.watch_skipped_frame(values, a["code"], reason, adopt)
                found = [p for _, _, p in frame.trainable_parameters(values)]
                # asked again at each call (a later model); not past the recompile limit, where
                # Dynamo runs the cached graphs only and a new model is refused above
                if found and not exceeded:  # handed over only where gradients are on
                    given_up.mark_given_up(a.get("frame_state"), a["code"], reason,
                                           found if torch.is_grad_enabled() else ())
                if adopt is not None and count:
                    log.warning(
                        'backend="spmd": Dynamo could not compile %s and runs it eagerly (%s); '
                        "the gradients it computes for %d parameter(s) are reduced at the end of "
                        "backward() as DDP reduces them (slower than a compiled graph: "
                        "TORCH_LOGS=graph_breaks shows why)", audit.where(a["code"]), reason, count)
            raise
        finally:
            broke = [r for r, n in counters["graph_break"].items()
                     if n > breaks.get(r, 0) and not r.startswith("spmd_backend")]
            audit.note_graph_breaks(a["code"], broke)
        if broke and torch.is_grad_enabled():
            _adopt_around_graph_breaks(values, a["code"], broke, options_of(compiler_fn))
        return result

    return _compile


def _adopt_around_graph_breaks(values: list[Any], code: Any, reasons: list[str],
                               options: dict[str, Any] | None) -> None:
    """Dynamo compiled ``code`` in pieces (``reasons``: its graph breaks): what runs between
    them runs eagerly, and with it every function Dynamo does not compile on its own (torch's
    modules: a ``BatchNorm`` with ``momentum=None`` broken at its ``.item()``, an ``LSTM``
    given a ``PackedSequence``; a ``torch._dynamo.disable``-d function given a parameter).
    Their gradients are computed eagerly: where the configuration reduces eager gradients
    (:func:`_eager_gradients`), the trainable parameters of the modules and optimizers the
    frame reaches are adopted before any of it runs (verified and broadcast once, as DDP's
    constructor; a parameter whose gradients all come from compiled graphs costs nothing more).
    Elsewhere they stay refused in ``backward()`` as before."""
    found = [(fqn, p) for _, fqn, p in frame.trainable_parameters(values)]
    adopt = _eager_gradients(options) if found else None
    if adopt is None:
        return
    for fqn, p in found:  # the post-accumulate audit counts their reduced gradients
        audit.watch(p, fqn)
    # only a backward() in which a compiled graph's check ran on every rank reduces them: the
    # model's parameters are reached by any frame with a graph break (a logging call), and an
    # eager backward outside the step on one rank must not start a collective there
    adopt(values, found, False)
    key = (code, len(found))
    if key not in _ADOPTED_NOTED:
        _ADOPTED_NOTED.add(key)
        log.info('backend="spmd": %s is compiled in pieces (graph break: %s); the gradients '
                 "computed eagerly between them, for any of the %d parameter(s) it reaches, are "
                 "reduced at the end of backward() as DDP reduces them", audit.where(code),
                 reasons[0][:200], len(found))


#: (code, parameter count) already logged by :func:`_adopt_around_graph_breaks`
_ADOPTED_NOTED: set[tuple[Any, int]] = set()


#: the compile stances (``torch.compiler.set_stance``) that run a frame eagerly although it
#: could be compiled: for this backend's frames they compile as in the default stance
_EAGER_STANCES = ("eager_then_compile", "aot_eager_then_compile", "eager_on_recompile")


def _wrap_callback_from_stance(original: Callable[..., Any], ours: Callable[[Any], bool],
                               options_of: Callable[[Any], dict[str, Any] | None]) -> Callable[..., Any]:
    """Dynamo's choice of the frame callback under the compile stance, for this backend's
    callback: ``force_eager`` gets a callback that refuses a frame reaching a trainable
    parameter on more than one rank (else runs it and its callees eagerly, as the stance
    does); the stances that run some calls eagerly to save compiles keep the callback (warned
    once). Raising inside the callback, not here, lets Dynamo's call wrapper restore its state."""
    from torch._dynamo import eval_frame
    from torch._dynamo.types import ConvertFrameReturn, FrameAction, FrameExecStrategy

    warned: set[str] = set()

    @functools.wraps(original)
    def _callback_from_stance(callback: Any) -> Any:
        stance = eval_frame._stance.stance
        if stance == "default" or callback in (False, None) or not ours(callback):
            return original(callback)
        if stance in _EAGER_STANCES:
            if stance not in warned:
                warned.add(stance)
                warnings.warn(
                    f'torch.compiler.set_stance("{stance}") is not applied to backend="spmd" '
                    "steps: an eager call would not reduce the gradients across ranks; they "
                    "compile as in the default stance", stacklevel=2)
            return callback
        if stance != "force_eager":
            return original(callback)
        options = options_of(callback)

        def refuse_or_run_eagerly(dynamo_frame: Any, cache_entry: Any, frame_state: Any) -> Any:
            refused = _eager_refusal(
                _values_of(dynamo_frame), options, audit.where(dynamo_frame.f_code),
                ('torch.compiler.set_stance("force_eager")', "use the default stance for the step"))
            if refused is not None:
                raise refused
            return ConvertFrameReturn(
                frame_exec_strategy=FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP),
                apply_to_code=False)

        return refuse_or_run_eagerly

    return _callback_from_stance


def _values_of(f: Any) -> list[Any]:
    """What a Dynamo frame object reaches (:func:`spmd_backend.dynamo.frame.frame_values`)."""
    return frame.frame_values(f.f_code, f.f_locals, f.f_globals, f.closure)


def install(ours: Callable[[Any], bool], options_of: Callable[[Any], dict[str, Any] | None]) -> None:
    """Wrap ``torch._dynamo.optimize``, Dynamo's ``_compile``, its frame callback and per-frame
    skip and its choice of callback under a stance (once). ``ours`` tells a backend of this package, ``options_of``
    its ``options``."""
    import torch._dynamo
    import torch._dynamo.convert_frame as convert_frame

    if not getattr(convert_frame._compile, "_spmd_eager_guard", False):
        convert_frame._compile = _refusing_eager_fallback(convert_frame._compile, ours, options_of)
        convert_frame._compile._spmd_eager_guard = True  # type: ignore[attr-defined]

    if not getattr(torch._dynamo.optimize, "_spmd_eager_guard", False):
        torch._dynamo.optimize = _wrap_optimize(torch._dynamo.optimize, ours, options_of)
        torch._dynamo.optimize._spmd_eager_guard = True  # type: ignore[attr-defined]
    import torch._dynamo.eval_frame as eval_frame

    if not getattr(eval_frame._callback_from_stance, "_spmd_eager_guard", False):
        eval_frame._callback_from_stance = _wrap_callback_from_stance(
            eval_frame._callback_from_stance, ours, options_of)
        eval_frame._callback_from_stance._spmd_eager_guard = True  # type: ignore[attr-defined]
    wrapper = convert_frame.CatchErrorsWrapper
    if not getattr(wrapper.__call__, "_spmd_eager_guard", False):
        wrapper.__call__ = _wrap_catch_errors_call(wrapper.__call__, ours, options_of)  # type: ignore[method-assign]
        wrapper.__call__._spmd_eager_guard = True  # type: ignore[attr-defined]
    if not getattr(wrapper._handle_skip, "_spmd_eager_guard", False):
        wrapper._handle_skip = _wrap_handle_skip(wrapper._handle_skip, ours, options_of)  # type: ignore[method-assign]
        wrapper._handle_skip._spmd_eager_guard = True  # type: ignore[attr-defined]


__all__ = ["group_size", "install", "trained_parameter"]
