"""Point an optimizer at the lifted tensors for a trace, in its traceable (capturable) form.

:func:`optimizer_swapped` replaces each param group's parameters, the optimizer state and the
lifted hyper-parameters by the trace's functional tensors, turns on ``capturable`` (tensor math,
no ``.item()`` on step counts), pins the implementation
:func:`~spmd_backend.tracing.hyperparams.traced_implementation` chose, and marks the optimizer
phase while ``step()`` runs (with a :class:`~spmd_backend.tracing.sharding.ShardedStep`, on
this rank's shards of the parameters). Each param group is replaced by a
:class:`~spmd_backend.tracing.tracked.RecordingGroup`, so the keys the step reads become the
graph's guards. While ``step()`` runs, a lifted value compared with zero (torch's optimizers
branch on ``if weight_decay != 0`` and ``if momentum > 0``) answers from its real value, and
the comparison is recorded: the graph then guards on the value's sign; a lifted ``alpha=`` of
``add`` becomes a product. A step that changes a
param group entry itself (a Python step counter in the group, as some third-party optimizers
keep) is refused: no graph can replay it. Everything (the user's group dicts included) is
restored in a ``finally`` block.
"""

from __future__ import annotations

import collections
import contextlib
import operator
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from spmd_backend.errors import SpmdUsageError
from spmd_backend.tracing.dispatch import TraceContext
from spmd_backend.tracing.hyperparams import HyperSlot, install, slot_value, traced_implementation
from spmd_backend.tracing.key import user_hooks
from spmd_backend.tracing.sharding import ShardedStep
from spmd_backend.tracing.tracked import ReadRecorder, RecordingGroup

_T = torch._C.TensorBase
_MISSING = object()
#: tensor comparison methods (``t != 0`` arrives as ``TensorBase.ne``) -> the Python operator
_COMPARISONS = {
    getattr(_T, name): op
    for names, op in (
        (("ne", "__ne__"), operator.ne), (("eq", "__eq__"), operator.eq),
        (("gt", "__gt__"), operator.gt), (("ge", "__ge__"), operator.ge),
        (("lt", "__lt__"), operator.lt), (("le", "__le__"), operator.le),
    )
    for name in names
}


#: ``Tensor.addcmul_`` as a torch-function override sees it
_ADDCMUL_INPLACE = frozenset({_T.addcmul_, torch.Tensor.addcmul_})


class _LiftedUses(TorchFunctionMode):
    """Serve the uses of lifted tensors that torch's optimizer code makes as Python numbers.

    ``lifted <op> 0`` is answered from the lifted value's real value, and the slot reported: on
    the trace's tensors such a test is a data-dependent branch. Only a comparison of a lifted
    tensor (by identity) with the number zero is answered, as the Python bool eager computes;
    reflected forms (``0 < t``) arrive as ``t.gt(0)``. With ``alphas``, ``x.add(y,
    alpha=lifted)`` (nesterov SGD's momentum, lifted only where it moves:
    hyperparams.MOVING_LIFTABLE) becomes ``x.add(y * lifted)``: torch's argument parser refuses
    a traced tensor as ``alpha`` before any mode sees the call, so ``torch.Tensor.add`` itself is
    wrapped while the step runs.
    """

    def __init__(
        self, values: dict[int, tuple[HyperSlot, float]], report: Callable[[HyperSlot], None],
        alphas: bool = False,
    ) -> None:
        super().__init__()
        self.values = values
        self.report = report
        self.alphas = alphas
        self._saved_add: Any = _MISSING
        self._depth = 0  # a subclass's step() calling super().step() enters twice

    def __enter__(self):  # type: ignore[no-untyped-def]
        self._depth += 1
        if self.alphas and self._depth == 1:
            self._saved_add = torch.Tensor.__dict__.get("add", _MISSING)
            lifted, add, thread = self.values, torch.Tensor.add, threading.get_ident()

            def add_with_lifted_alpha(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                alpha = kwargs.get("alpha")
                if len(args) == 1 and alpha is not None and id(alpha) in lifted \
                        and threading.get_ident() == thread:
                    rest = {k: v for k, v in kwargs.items() if k != "alpha"}
                    return add(t, args[0] * alpha, **rest)
                return add(t, *args, **kwargs)

            torch.Tensor.add = add_with_lifted_alpha  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._depth -= 1
            if self.alphas and self._depth == 0:
                if self._saved_add is _MISSING:
                    if "add" in torch.Tensor.__dict__:
                        delattr(torch.Tensor, "add")
                else:
                    torch.Tensor.add = self._saved_add  # type: ignore[method-assign]
                self._saved_add = _MISSING

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if func in _ADDCMUL_INPLACE and self._weight_decay_factor(args, kwargs):
            # torch's "differentiable" weight decay, taken because lifted tensors require grad:
            # `grad = grad.addcmul_(param.clone(), weight_decay)` would write the decay into the
            # parameter's .grad, which eager's `grad.add(param, alpha=wd)` leaves as it was (the
            # update itself, `param.addcmul_(grad, lr, value=-1)`, stays in place)
            return torch.addcmul(*args, **kwargs)
        op = _COMPARISONS.get(func)
        if op is not None and len(args) == 2 and not kwargs:
            hit = self.values.get(id(args[0]))
            other = args[1]
            if hit is not None and type(other) in (int, float) and other == 0:
                self.report(hit[0])
                return op(hit[1], 0)
        return func(*args, **kwargs)

    def _weight_decay_factor(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        factors = list(args[1:3]) + [kwargs.get("tensor1"), kwargs.get("tensor2")]
        hits = [self.values.get(id(f)) for f in factors if f is not None]
        return any(hit is not None and hit[0][1] == "weight_decay" for hit in hits)


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an object without a usable ==: treat as changed
        return False


def _refuse_group_updates(opt: torch.optim.Optimizer, saved_groups: list[dict]) -> None:
    """Raise if the traced ``step()`` changed a param group entry (a Python step counter kept in
    the group, ``group['step'] += 1``): the graph replays tensor updates only, so every replay
    would reuse whatever the trace computed from that value (bias corrections baked in at the
    traced step) and the user's group would never advance. Whether the update uses the value
    cannot be told from the trace (it may flow through a local variable), so every change is
    refused."""
    for g, (group, saved) in enumerate(zip(opt.param_groups, saved_groups)):
        if not isinstance(group, RecordingGroup):
            continue
        for k in sorted(group.written, key=str):
            before, after = saved.get(k, _MISSING), dict.get(group, k, _MISSING)
            if k == "params" or _same(before, after):
                continue
            was = "absent" if before is _MISSING else repr(before)[:60]
            now = "removed" if after is _MISSING else (
                "a tensor" if isinstance(after, torch.Tensor) else repr(after)[:60])
            if k in group.written_outside:
                from torch.optim.optimizer import _global_optimizer_pre_hooks

                # ours is one of the instance's; a hook of the user's runs before it
                hooks = (" (or a step pre-hook of the optimizer's)"
                         if len(opt._optimizer_step_pre_hooks) > 1
                         or user_hooks(_global_optimizer_pre_hooks) else "")
                raise SpmdUsageError(
                    f"spmd_backend.compile: the train step{hooks} sets param_groups[{g}][{k!r}] "
                    f"({was} -> {now}) itself, outside {type(opt).__name__}.step() (a warmup "
                    "written inside the step); a compiled graph replays tensor operations, not "
                    "Python writes to the optimizer, so the group would keep the value the "
                    f"trace saw. Set it before calling the compiled step (for g in "
                    f"opt.param_groups: g[{k!r}] = ...: the graph reads the group's value as an "
                    "input, without retracing), or step an LR scheduler after the call. "
                    "Nothing was changed."
                )
            # a tensor counter in the group (timm's Lamb): Dynamo guards on the group and
            # carries the tensor, so the other door runs it
            dynamo = (', or torch.compile(step, backend="spmd"), which runs it'
                      if isinstance(after, torch.Tensor) else "")
            raise SpmdUsageError(
                f"spmd_backend.compile: {type(opt).__name__}.step() changes "
                f"param_groups[{g}][{k!r}] ({was} -> {now}), an entry the optimizer sets "
                "itself (a step counter kept in the param group); a compiled graph carries "
                "optimizer state between calls only in optimizer.state, so every call would "
                "reuse the value the trace saw. Use an optimizer that keeps such counters in "
                f"its state (as torch.optim's do){dynamo}"
            )


@contextlib.contextmanager
def optimizer_swapped(
    opt: torch.optim.Optimizer,
    f_params: list[torch.Tensor],
    index: dict[int, int],
    f_state: dict[int, dict[str, Any]],
    f_hyper: dict[HyperSlot, torch.Tensor],
    ctx: TraceContext,
    recorder: ReadRecorder,
    unfused_groups: frozenset[int] = frozenset(),
    sharded: ShardedStep | None = None,
) -> Iterator[collections.defaultdict]:
    """Point the optimizer at the lifted tensors for the trace; always restore it."""
    saved_groups = list(opt.param_groups)
    saved_state = opt.state
    new_state: collections.defaultdict = collections.defaultdict(dict)
    for i, entries in f_state.items():
        new_state[f_params[i]] = dict(entries)

    zero_tests = _LiftedUses(
        {id(t): (slot, float(slot_value(opt, slot))) for slot, t in f_hyper.items()},
        recorder.compared_with_zero, alphas=bool(unfused_groups),
    )
    in_step = contextlib.ExitStack()
    #: step() calls under way: a subclass's step() calling super().step() runs the hooks twice,
    #: nested, and the inner post-hook must not end the outer step
    depth = [0]

    def pre_hook(*_: object) -> None:
        depth[0] += 1
        ctx.in_optimizer = True
        in_step.enter_context(zero_tests)
        if sharded is not None:
            sharded.enter(opt)

    def post_hook(*_: object) -> None:
        depth[0] = max(depth[0] - 1, 0)
        if sharded is not None:
            sharded.exit(opt)
        in_step.close()
        ctx.in_optimizer = False

    handles = [opt.register_step_pre_hook(pre_hook), opt.register_step_post_hook(post_hook)]
    # a fused optimizer's group traced single-tensor (a moving betas[0]/momentum) cannot take a
    # GradScaler's grad_scale/found_inf: the scaler unscales and selects instead, as for any
    # unfused optimizer (until 2026-11-28 the trace failed on torch's assertion, every call)
    amp_scaling = opt.__dict__.get("_step_supports_amp_scaling", _MISSING)
    if getattr(opt, "_step_supports_amp_scaling", False) and any(
            traced_implementation(opt, group, g in unfused_groups) != "fused"
            for g, group in enumerate(saved_groups) if group["params"]):
        opt._step_supports_amp_scaling = False
    try:
        for g, group in enumerate(saved_groups):
            swapped = dict(group)
            swapped["params"] = [f_params[index[id(p)]] for p in group["params"]]
            for slot, t in f_hyper.items():
                if slot[0] == g:
                    install(swapped, slot, t)
            if "capturable" in swapped:
                swapped["capturable"] = True
            impl = traced_implementation(opt, group, g in unfused_groups)
            if "fused" in swapped:
                swapped["fused"] = impl == "fused"
            if "foreach" in swapped:
                swapped["foreach"] = impl == "foreach"
            opt.param_groups[g] = RecordingGroup(
                swapped, lambda k, _g=g: recorder.read_group_key(_g, k),
                in_step=lambda: depth[0] > 0,
            )
        opt.state = new_state
        yield new_state
        _refuse_group_updates(opt, saved_groups)
    finally:
        in_step.close()
        for h in handles:
            h.remove()
        ctx.in_optimizer = False
        opt.state = saved_state
        opt.param_groups[:] = saved_groups
        if amp_scaling is _MISSING:
            opt.__dict__.pop("_step_supports_amp_scaling", None)
        else:
            opt._step_supports_amp_scaling = amp_scaling

