"""Errors of a failed trace, pointing at the user's code rather than at torch internals.

:func:`trace_error` turns an exception raised while tracing into an
:class:`~spmd_backend.errors.SpmdTraceError` that says what kind of problem it is (a real tensor
captured from outside, a Python decision on a tensor's value) and where: the line of the user's
step function and the innermost line outside torch and spmd_backend (a library such as
transformers) on the failing call's stack; a decision on a tensor's value made inside torch's
optimizers or modules (Adafactor's step sizes, BatchNorm's cumulative average, a recurrent
layer's packed batch sizes used as a size, ``AveragedModel.update_parameters``'s first-update
test, torch.distributions' argument validation) names torch's line too, with what the user can
do about it. :func:`user_frame` gives that innermost line for any stack.
"""

from __future__ import annotations

import os
import re
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch

from spmd_backend.errors import SpmdTraceError

_DATA_DEPENDENT = (
    "GuardOnDataDependentSymNode", "DataDependentOutputException", "DynamicOutputShapeException",
)
_LIBRARY_DIRS = (
    os.path.dirname(torch.__file__),
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
)
_TORCH_OPTIM_DIR = os.path.join(os.path.dirname(torch.__file__), "optim") + os.sep
_TORCH_NN_DIR = os.path.join(os.path.dirname(torch.__file__), "nn") + os.sep
_SWA_UTILS = _TORCH_OPTIM_DIR + "swa_utils.py"
_TORCH_DISTRIBUTIONS_DIR = os.path.join(os.path.dirname(torch.__file__), "distributions") + os.sep
#: what to do about a torch module's decision on a tensor value, by the module's file
_MODULE_HINTS = {
    "batchnorm.py": "a BatchNorm with momentum=None (a cumulative average) reads "
                    "num_batches_tracked as a Python number on every step; give it a momentum "
                    "(torch's default is 0.1)",
    "rnn.py": "a recurrent layer given a PackedSequence (pack_padded_sequence) reads its batch "
              "sizes as Python numbers; pass the padded batch and mask the padded steps instead",
}


def is_user_frame(frame: traceback.FrameSummary) -> bool:
    """A frame of the user's code: outside torch and spmd_backend, not generated code."""
    return not frame.filename.startswith(_LIBRARY_DIRS) and not frame.filename.startswith("<")


def _describe(frame: traceback.FrameSummary) -> str:
    return f"{frame.filename}:{frame.lineno} `{(frame.line or '').strip()}`"


def user_frame(frames: Sequence[traceback.FrameSummary]) -> str:
    """The innermost frame outside torch and spmd_backend, described (or "")."""
    user = [f for f in frames if is_user_frame(f)]
    return _describe(user[-1]) if user else ""


def _frames(e: BaseException) -> list[traceback.FrameSummary]:
    frames: list[traceback.FrameSummary] = []
    seen: set[int] = set()
    exc: BaseException | None = e
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        frames = traceback.extract_tb(exc.__traceback__) + frames
        exc = exc.__cause__ or exc.__context__
    return frames


def _where(e: BaseException, fn: Callable[..., Any], named: str = "") -> str:
    """Where the failure is in the user's code: the step's line and, if deeper, the innermost
    line outside torch (unless the message names it already: ``named``)."""
    frames = [f for f in _frames(e) if is_user_frame(f)]
    step_file = getattr(getattr(fn, "__code__", None), "co_filename", None)
    parts = []
    in_step = [f for f in frames if f.filename == step_file]
    if in_step:
        parts.append(f"your step at {_describe(in_step[-1])}")
    if frames and (not in_step or frames[-1] is not in_step[-1]) and _describe(frames[-1]) != named:
        parts.append(f"called from {_describe(frames[-1])}")
    return "; ".join(parts)


def _user_frames_below(frames: list[traceback.FrameSummary],
                       frame: traceback.FrameSummary) -> list[traceback.FrameSummary]:
    """The frames outside torch and spmd_backend called (directly or not) by ``frame``: a
    third-party optimizer under torch's step wrapper, a forward hook or user module under a
    torch container (then the decision is theirs, not torch's)."""
    return [f for f in frames[frames.index(frame) + 1:] if is_user_frame(f)]


def _tensor_as_number(e: Exception) -> bool:
    """A torch function wanted a Python number (a size) and got a traced tensor: eagerly it
    would have read the tensor's value (``torch.zeros(n, batch_sizes[0])``)."""
    msg = str(e)
    return isinstance(e, TypeError) and ("FunctionalTensor" in msg or "FakeTensor" in msg)


def _averaged_model_update(e: Exception) -> traceback.FrameSummary | None:
    """The frame of ``AveragedModel.update_parameters`` that failed (not a user module's forward
    it called), or None."""
    frames = _frames(e)
    inside = [f for f in frames if f.filename == _SWA_UTILS and f.name == "update_parameters"]
    return inside[-1] if inside and not _user_frames_below(frames, inside[-1]) else None


def trace_error(e: Exception, fn: Callable[..., Any]) -> SpmdTraceError:
    """``e`` (raised while tracing ``fn``) as an error that names its kind and place."""
    msg = str(e)
    where = _where(e, fn)
    at = f" ({where})" if where else ""
    swa = _averaged_model_update(e)
    if swa is not None:
        # the averaged copy is rarely an argument of the step, and its first update is a Python
        # decision on its counter: neither advice below (pass it in; keep values tensors) helps
        place = f"torch/optim/{_describe(swa)[len(_TORCH_OPTIM_DIR):]}"
        where = _where(e, fn, named=place)
        at = f" ({where})" if where else ""
        return SpmdTraceError(
            f"torch's AveragedModel.update_parameters at {place}{at} decides on the value of its "
            "n_averaged counter (whether this is the first update), which one compiled graph "
            "cannot replay: call ema.update_parameters(model) after the compiled step, outside "
            "it (the parameters are the same on every rank after the step, so is each rank's "
            'average), or compile the step with torch.compile(step, backend="spmd"), which runs '
            f"the update between its graphs. ({type(e).__name__}: {msg.splitlines()[0][:200]})"
        )
    if re.search(r"backward through spmd_backend\.grad_(ready|contribution)", msg):
        # backward(create_graph=True), then a term of p.grad: the gradient it differentiates is
        # the one backward() accumulated, which the step reduces across ranks
        return SpmdTraceError(
            f"the train step differentiates a gradient that backward() accumulated into .grad{at} "
            "(loss.backward(create_graph=True), then a penalty on p.grad): that gradient is the "
            "one reduced across ranks, and neither this backend nor DDP differentiates through "
            "the reduction. Compute the penalty's gradient with torch.autograd.grad(loss, "
            "params, create_graph=True), which stays this rank's own and matches DDP. Nothing "
            "was changed."
        )
    if "Please convert all Tensors to FakeTensors" in msg:
        return SpmdTraceError(
            "the train step used a real tensor that is neither a parameter, buffer, optimizer "
            "state nor an argument of the call (a tensor captured from an enclosing scope?); "
            "pass it as an argument (another module's weights, such as an EMA copy, as a list: "
            f"list(ema.parameters())) or register it as a buffer{at}; one a library keeps "
            "(peft's prompt tokens) is taken as a graph input by "
            f'torch.compile(step, backend="spmd"). ({msg[:300]})'
        )
    if "mutating a non-functional tensor with a functional tensor" in msg:
        # functionalization's own assertion, reached before the fake-tensor check above
        return SpmdTraceError(
            "the train step wrote into a real tensor that is neither a parameter, buffer, "
            "optimizer state nor an argument of the call (a running total captured from an "
            "enclosing scope, `TOTAL.add_(loss.detach())`?); the graph would never repeat that "
            "write. Register it as a buffer of the model (written back after each call), or "
            f"return the value from the step and accumulate it after the call{at}. (torch's "
            "functionalization: mutating a non-functional tensor with a functional tensor is "
            "not allowed)"
        )
    if type(e).__name__ in _DATA_DEPENDENT or "data-dependent" in msg or _tensor_as_number(e):
        frames = _frames(e)
        in_optim = [f for f in frames if f.filename.startswith(_TORCH_OPTIM_DIR)]
        if in_optim:
            # the user cannot change the optimizer's code: say whose decision it is (torch's,
            # or a third-party optimizer's that torch's step wrapper called)
            below = _user_frames_below(frames, in_optim[-1])
            place = (_describe(below[-1]) if below else
                     f"torch/optim/{_describe(in_optim[-1])[len(_TORCH_OPTIM_DIR):]}")
            where = _where(e, fn, named=place)
            at = f" ({where})" if where else ""
            return SpmdTraceError(
                f"the optimizer's step makes a Python decision on a tensor's value at {place}"
                f"{at}, which one compiled graph cannot replay for other values: "
                'spmd_backend.compile cannot trace this optimizer. torch.compile(step, backend="spmd") '
                "runs it (Dynamo splits the step where the optimizer reads the value). "
                f"({type(e).__name__}: {msg.splitlines()[0][:200]})"
            )
        in_nn = [f for f in frames if f.filename.startswith(_TORCH_NN_DIR)
                 and os.path.basename(f.filename) != "module.py"]
        if in_nn and not _user_frames_below(frames, in_nn[-1]):
            # a torch module decides (its settings do): name its line, not only the step's
            frame = in_nn[-1]
            hint = _MODULE_HINTS.get(os.path.basename(frame.filename))
            does = (
                # an op whose output's shape is computed from tensor values (ctc_loss with
                # tensor lengths), not a decision in Python: say so
                "calls an op whose output shape depends on a tensor's values"
                if type(e).__name__ == "DynamicOutputShapeException"
                else "makes a Python decision on a tensor's value"
            )
            return SpmdTraceError(
                f"a torch module {does} at "
                f"torch/nn/{_describe(frame)[len(_TORCH_NN_DIR):]}{at}, which one compiled "
                f"graph cannot replay for other values{': ' + hint if hint else ''}. "
                f"({type(e).__name__}: {msg.splitlines()[0][:200]})"
            )
        in_dist = [f for f in frames if f.filename.startswith(_TORCH_DISTRIBUTIONS_DIR)]
        if in_dist and not _user_frames_below(frames, in_dist[-1]):
            # torch.distributions checks arguments and samples against their constraints unless
            # told not to (the default follows __debug__): a check the user can switch off
            frame = in_dist[-1]
            return SpmdTraceError(
                "torch.distributions checks a distribution's parameters (and the values given to "
                "log_prob) against their constraints at "
                f"torch/distributions/{_describe(frame)[len(_TORCH_DISTRIBUTIONS_DIR):]}{at}, a "
                "Python decision on tensor values that one compiled graph cannot replay: "
                "construct the distribution with validate_args=False, or call "
                "torch.distributions.Distribution.set_default_validate_args(False) once before "
                'the first step (or compile with torch.compile(step, backend="spmd"), which runs '
                f"the check between its graphs). ({type(e).__name__}: "
                f"{msg.splitlines()[0][:200]})"
            )
        return SpmdTraceError(
            "the train step makes a Python decision on a tensor's value (.item(), bool(tensor), "
            f"a data-dependent shape){at}, which one compiled graph cannot replay for other "
            "values. Keep the value a tensor (torch.where instead of if, no .item() in the "
            f"step) or move it out of the step. ({type(e).__name__}: {msg.splitlines()[0][:200]})"
        )
    if isinstance(e, TypeError) and any(f"Sym{k}" in msg for k in ("Float", "Int", "Bool")):
        # ``f"{loss.item():.4f}"``: the number is a symbol while the step is traced
        return SpmdTraceError(
            f"the train step uses a number read from a tensor (.item(), float(t)) as a Python "
            f"value{at}: while the step is traced it is a symbol, and the compiled graph replays "
            "tensor operations only, so Python that formats or prints it runs once, with no "
            "call's value. Return the tensor (loss.detach()) and format it after the call, or "
            'compile with torch.compile(step, backend="spmd"), which runs that Python on every '
            f"call. ({type(e).__name__}: {msg.splitlines()[0][:200]})"
        )
    return SpmdTraceError(f"tracing the train step failed{at}: {type(e).__name__}: {msg}")
