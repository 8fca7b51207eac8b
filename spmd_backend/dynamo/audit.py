"""Never unsynchronized: every parameter gradient must pass a collective.

When Dynamo cannot capture a whole step (a graph break inside the model), gradients come from
several graphs, and a gradient computed by an eagerly run region would reach ``.grad`` without a
collective; when Dynamo gives up on a frame altogether (its recompile limit) the whole step would
run eagerly: :func:`refuse_eager_fallback` refuses such a frame before it runs (the scope calls it
from Dynamo's compile), when it reaches a module whose parameters are watched; a frame Dynamo
gives up on while compiling it (a graph break it cannot resume from) has its trainable
parameters watched (:func:`watch_skipped_frame`), so an eager gradient raises (or, in
per-graph mode on a checked group, is reduced at the end of ``backward()``:
:mod:`spmd_backend.dynamo.eager_grads`). Gradients
computed inside a compiled graph never trigger the hook (no AccumulateGrad runs), so it costs
nothing in whole-step mode. :func:`watch` gives each parameter a post-accumulate-grad hook whose
state (how many reduced gradients are pending, whether any was reduced since the last optimizer
step) lives in the hook object itself, found again through the parameter's hook dict: no
process-wide table. A compiled backward graph that reduced a parameter's gradient calls
:func:`mark_reduced` (a whole-step graph that stops before the optimizer step:
:func:`mark_reduced_in_graph`); a gradient accumulated without a pending reduction raises
:class:`~spmd_backend.errors.SpmdUsageError` during ``backward()``, and
:func:`check_before_step` raises before an optimizer-step graph uses a gradient that no compiled
backward reduced. Both errors quote the last graph break Dynamo reported while compiling a frame
for this backend (:func:`note_graph_breaks`, called from Dynamo's compile by eager_guard). In
per-graph mode a tensor hook (:func:`watch_incoming`) also checks the gradient about to be
accumulated against the contributions compiled backward graphs reduced for it
(:func:`record_reduced`): autograd sums a compiled and an eager contribution before either hook
sees them.
"""

from __future__ import annotations

import dis
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from spmd_backend.dynamo.frame import trainable_parameters
from spmd_backend.errors import SpmdUsageError
from spmd_backend.tracing.object_state import GLOBAL_MODULE_HOOKS, global_module_hooks


class _Audit:
    """The hook: counts reduced gradients pending accumulation into one parameter."""

    #: not a user's hook: the compile door does not run it in its trace
    spmd_internal = True

    def __init__(self, fqn: str) -> None:
        self.fqn = fqn
        self.pending = 0
        self.reduced_since_step = False
        #: the last frame reaching this parameter that Dynamo gave up on and ran eagerly
        #: (:func:`watch_skipped_frame`), named in the error
        self.skipped: str | None = None

    def __call__(self, param: torch.Tensor) -> None:
        if self.pending > 0:
            self.pending -= 1
            return
        if self.skipped is not None:
            cause = f"{self.skipped}; TORCH_LOGS=graph_breaks shows why"
        else:
            cause = f"{_eager_cause()}: TORCH_LOGS=recompiles shows why"
        raise SpmdUsageError(
            f'backend="spmd": the gradient of parameter {self.fqn!r} was computed outside the '
            f"spmd-compiled graphs ({cause}), so it would not be synchronized across ranks; "
            "remove the graph break (torch._dynamo.explain shows it) or compile the model with "
            "fullgraph=True"
        )


#: the last graph break Dynamo reported while compiling a frame for this backend, quoted by the
#: audit's errors as a place to look (diagnostics only: nothing decides on it)
_last_graph_break: str | None = None


def where(code: Any) -> str:
    name = getattr(code, "co_name", "?")
    return f"{name} ({getattr(code, 'co_filename', '?')}:{getattr(code, 'co_firstlineno', '?')})"


def note_graph_breaks(code: Any, reasons: list[str]) -> None:
    """Dynamo broke the graph of ``code`` (a frame compiled for this backend) for ``reasons``."""
    global _last_graph_break
    if reasons:
        _last_graph_break = f"in {where(code)}: {'; '.join(r[:200] for r in reasons)}"


def _eager_cause() -> str:
    """Why a gradient may have been computed eagerly, with the last graph break Dynamo reported."""
    last = ("" if _last_graph_break is None else
            f" (the last graph break Dynamo reported in a spmd step was {_last_graph_break})")
    return ("a graph break inside the model ran part of it eagerly, or Dynamo stopped compiling "
            f"the step after its recompile limit{last}")


class _IncomingAudit:
    """Per-graph mode's tensor hook on a parameter: the gradient about to be accumulated must be
    exactly what compiled backward graphs reduced for it in this ``backward()``.

    Autograd sums every contribution to a parameter's gradient before accumulating it, so a
    parameter used both inside a compiled graph and in an eager region of the same step (a
    ``torch._dynamo.disable``-d function given ``self.emb.weight``) reached the post-accumulate
    audit as one gradient, counted as reduced, with the eager part never reduced: 0.0144 off
    DDP after three steps in the probe. The compiled backward node records its reduced
    contributions (:func:`record_reduced`, holding them so that autograd sums out of place);
    one contribution must be the very tensor that arrives, several their sum in arrival order
    (bitwise, as autograd adds them; NaN equal to NaN, as under a GradScaler's overflow). A
    gradient with no recorded contribution is left to the post-accumulate audit (an eager-only
    gradient raises there). Contributions are recorded only where the parameter's accumulation
    runs in that ``backward()`` (not for ``torch.autograd.grad`` with respect to inputs), and a
    new record drops those of other graph tasks (a ``backward()`` that failed midway), so at
    most one step's records outlive their task."""

    #: not a user's hook: the compile door and the hook refusal skip it
    spmd_internal = True

    def __init__(self, fqn: str) -> None:
        self.fqn = fqn
        self.reduced: list[tuple[int, torch.Tensor]] = []  # (graph task id, gradient)
        #: where the parameter's eager gradient parts go to be reduced, once a frame Dynamo
        #: gave up on or compiled in pieces reached it (:mod:`spmd_backend.dynamo.eager_grads`);
        #: None: refused
        self.eager: Any = None
        #: an eager part alone makes its backward() reduce them on every rank (a frame Dynamo gave
        #: up on runs eagerly inside the step on every rank); else only a backward() in which the
        #: per-graph check ran (a compiled graph's backward on every rank)
        self.opens = False
        self._param: weakref.ref | None = None

    def adopt(self, registry: Any, param: torch.Tensor, opens: bool) -> None:
        """Hand ``param``'s eager gradient parts to ``registry.collect`` from now on (the
        parameter held weakly: its accumulator node, which holds it, is looked up per call)."""
        self.eager = registry
        self.opens = self.opens or opens
        self._param = weakref.ref(param)

    @torch.compiler.disable  # autograd runs it inside a compiled step's backward(): not traced
    def __call__(self, grad: torch.Tensor) -> None:
        task = torch._C._current_graph_task_id()
        mine = [g for t, g in self.reduced if t == task]
        self.reduced = [(t, g) for t, g in self.reduced if t != task]
        if (len(mine) == 1 and grad is mine[0]) or grad.is_sparse:
            return
        total = None
        if mine:
            total = mine[0]
            for g in mine[1:]:
                total = total + g
            if len(mine) > 1 and bool(torch.isclose(grad, total, rtol=0, atol=0, equal_nan=True).all()):
                return
        param = self._param() if self._param is not None else None
        if self.eager is not None and param is not None:
            if not accumulates(torch.autograd.graph.get_gradient_edge(param).node):
                return  # torch.autograd.grad: nothing accumulates, nothing is reduced (as DDP)
            if not mine:
                mark_reduced((param,))  # reduced at the end of this backward()
            self.eager.collect(param, self.fqn, grad if total is None else grad - total, total,
                               self.opens)
            return
        if not mine:
            return  # an eager-only gradient: the post-accumulate audit raises
        raise SpmdUsageError(
            f'backend="spmd": the gradient of parameter {self.fqn!r} comes partly from a '
            "compiled graph, where it is reduced across ranks, and partly from code that runs "
            "eagerly (a torch._dynamo.disable-d function or a region Dynamo does not compile, "
            "given the parameter itself), where it is not: autograd sums both, and the sum "
            "would not be synchronized. The optimizer has not stepped. Pass the eager code a "
            "module's output instead of the parameter, or remove the graph break"
        )


def accumulates(node: Any) -> bool:
    """Whether the running ``backward()`` executes the gradient accumulator ``node`` (False under
    ``torch.autograd.grad``, which captures gradients instead: torch refuses to answer for a
    leaf's node there)."""
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:
        return False


def watch_incoming(param: torch.Tensor, fqn: str) -> None:
    """Give ``param`` the incoming-gradient audit of per-graph mode (idempotent)."""
    if param.requires_grad and incoming_audit_of(param) is None:
        param.register_hook(_IncomingAudit(fqn))


def incoming_audit_of(param: torch.Tensor) -> _IncomingAudit | None:
    """``param``'s incoming-gradient audit, or None."""
    hooks = getattr(param, "_backward_hooks", None) or {}
    return next((h for h in hooks.values() if isinstance(h, _IncomingAudit)), None)


def record_reduced(param: torch.Tensor, grad: torch.Tensor) -> None:
    """A compiled backward graph reduced ``grad``, its contribution to ``param``'s gradient in
    the running ``backward()``. Autograd sums a parameter's contributions and accumulates once,
    so only the first of this ``backward()`` counts as a pending reduced gradient
    (:func:`mark_reduced`; counting each let pending reduced gradients pile up for a weight
    used twice, and a later eager gradient pass as reduced)."""
    task = torch._C._current_graph_task_id()
    for h in (getattr(param, "_backward_hooks", None) or {}).values():
        if isinstance(h, _IncomingAudit):
            h.reduced = [(t, g) for t, g in h.reduced if t == task]
            if not h.reduced:
                mark_reduced((param,))
            h.reduced.append((task, grad))
            return
    mark_reduced((param,))


def _audit_of(param: torch.Tensor) -> _Audit | None:
    hooks = getattr(param, "_post_accumulate_grad_hooks", None) or {}
    return next((h for h in hooks.values() if isinstance(h, _Audit)), None)


def watch(param: torch.Tensor, fqn: str) -> None:
    """Audit ``param``'s gradients from now on (idempotent)."""
    if param.requires_grad and _audit_of(param) is None:
        param.register_post_accumulate_grad_hook(_Audit(fqn))


def _has_loop(code: Any) -> bool:
    """Whether ``code`` iterates (a ``for`` loop); False for anything that is not a code object."""
    try:
        return any(i.opname == "FOR_ITER" for i in dis.get_instructions(code))
    except TypeError:
        return False


def watch_skipped_frame(values: Iterable[object], code: Any, reason: str,
                        adopt: Callable[[list[Any], list[tuple[str, torch.Tensor]]], None] | None = None) -> int:
    """Dynamo gave up on a frame compiled for this backend and runs it eagerly (``reason``: a
    graph break it cannot resume from, e.g. a generator it cannot rebuild, its recompile limit,
    or any error under ``torch._dynamo.config.suppress_errors``); watch the trainable
    parameters of the modules and optimizers the frame reaches, when gradients are enabled.
    Returns how many parameters it watches. ``adopt`` (per-graph mode on a group that reduces
    eager gradients, :mod:`spmd_backend.dynamo.eager_grads`) is given the frame's values and
    those ``(fqn, parameter)``: their eager gradient parts are then reduced at the end of
    ``backward()`` instead of raising.

    A module whose ``forward`` Dynamo compiles as a frame of its own (a user's module) still
    trains: its compiled backward reduces the gradients. Otherwise (``nn.Sequential``, the
    update written by hand in the skipped frame) the eager backward computed gradients that no
    collective reduced and nothing noticed, since no compiled graph had ever watched the
    parameters: each rank trained on its own gradients. Watched, such a gradient raises in
    ``backward()``, naming this frame."""
    if not torch.is_grad_enabled():  # an evaluation under no_grad: no gradient to watch
        return 0
    note = f"Dynamo could not compile {where(code)} and runs it eagerly: {reason}"
    if _has_loop(code):
        note += ("; a graph break inside a loop of this function (e.g. in each block of "
                 "`for layer in self.layers`) makes Dynamo give up on the whole function: unroll "
                 "the loop or remove the graph break")
    count = 0
    values = list(values)
    found = [(fqn, p) for _, fqn, p in trainable_parameters(values)]
    for fqn, p in found:
        watch(p, fqn)
    if adopt is not None and found:  # per-graph mode reduces its eager gradients
        adopt(values, found)
    for _, p in found:
        audit = _audit_of(p)
        if audit is not None:
            audit.skipped = note
            count += 1
    return count


def mark_reduced(params: Iterable[torch.Tensor]) -> None:
    """A compiled backward just produced reduced gradients for ``params``."""
    for p in params:
        audit = _audit_of(p)
        if audit is not None:
            audit.pending += 1
            audit.reduced_since_step = True


def mark_reduced_in_graph(params: Iterable[torch.Tensor]) -> None:
    """A whole-step graph without the optimizer (a graph break between ``loss.backward()`` and
    ``optimizer.step()``) just wrote reduced gradients into ``params``' ``.grad`` (no
    AccumulateGrad runs, so nothing is pending)."""
    for p in params:
        audit = _audit_of(p)
        if audit is not None:
            audit.reduced_since_step = True


def unmark_reduced(params: Iterable[torch.Tensor]) -> None:
    """Gradients :func:`mark_reduced` counted were not reduced after all: the optimizer step
    must refuse them."""
    for p in params:
        audit = _audit_of(p)
        if audit is not None:
            audit.reduced_since_step = False


def check_before_step(params: Iterable[torch.Tensor]) -> None:
    """Raise if a parameter about to be stepped holds a gradient nothing reduced."""
    for i, p in enumerate(params):
        if p.grad is None:
            continue
        audit = _audit_of(p)  # None: no compiled graph ever used this parameter
        if audit is None or not audit.reduced_since_step:
            name = audit.fqn if audit is not None else "used only outside compiled graphs"
            raise SpmdUsageError(
                f'backend="spmd": optimizer parameter #{i} ({name}, shape {list(p.shape)}) '
                f"has a gradient that no spmd-compiled backward reduced ({_eager_cause()}?); "
                "it would not be synchronized across ranks. "
                "Remove the graph break (torch._dynamo.explain shows it) or the cause of the "
                "recompiles (TORCH_LOGS=recompiles)"
            )
        audit.reduced_since_step = False


def refuse_eager_fallback(values: Iterable[object], code: Any, limit: str, limit_value: object) -> SpmdUsageError | None:
    """The error for a frame Dynamo would now run eagerly (its recompile ``limit`` is reached)
    when the frame reaches a module whose parameters the audit watches, else None.

    Eagerly run, such a step computes gradients no collective reduces: the audit raised in
    ``backward()``, after the eager forward had updated buffers (BatchNorm statistics) and the
    first gradient had been accumulated. Refused before the frame runs, nothing changes. A
    frame that reaches no trained module (a logging helper) still runs eagerly, as Dynamo
    would run it."""
    fqns = [a.fqn for v in values if isinstance(v, torch.nn.Module)
            for p in v.parameters() if (a := _audit_of(p)) is not None]
    if not fqns:
        return None
    from torch._dynamo.resume_execution import TORCH_DYNAMO_RESUME_IN_PREFIX

    name = getattr(code, "co_name", "?")
    where = f"{name} ({getattr(code, 'co_filename', '?')}:{getattr(code, 'co_firstlineno', '?')})"
    # a resume function continues a frame after a graph break: what came before has run
    before = (" (it continues the step after a graph break: the part before the break has run)"
              if name.startswith(TORCH_DYNAMO_RESUME_IN_PREFIX) else "")
    return SpmdUsageError(
        f'backend="spmd": Dynamo recompiled {where} up to its {limit} ({limit_value}) and would '
        "now run it eagerly, where the gradients of its parameters (e.g. "
        f"{fqns[0]!r}) would not be synchronized across ranks; it is refused before it "
        f"runs{before}. "
        "Dynamo's warning above gives the last reason (TORCH_LOGS=recompiles: all of them); "
        "typical causes: momentum or betas a scheduler moves on a fused optimizer, whose "
        "kernel takes them as Python numbers (OneCycleLR: cycle_momentum=False, or the "
        "default implementation), a scheduler's lr on bfloat16/float16 parameters (create the "
        "optimizer with lr=torch.tensor(...)), a Python number that changes per call where an "
        "op needs a constant (spmd_backend.compile lifts an optimizer's hyper-parameters as "
        "inputs); or raise torch._dynamo.config.recompile_limit"
    )


def refuse_gradient_hooks(params: dict[int, torch.Tensor], fqns: dict[int, str]) -> None:
    """Raise if a parameter carries a gradient hook of the user's (``register_hook``,
    ``register_post_accumulate_grad_hook``).

    Under DDP such a hook runs on this rank's gradient before the all-reduce. Here it cannot: a
    whole-step graph computes gradients inside the graph, where no hook of the real parameter
    runs, and in per-graph mode the hook would run on the already reduced gradient (for a
    clamp or any other non-linear hook, another result). Called when a graph is compiled and
    before each call of it, so a hook registered later is caught before anything runs.
    """
    for i, p in params.items():
        post = getattr(p, "_post_accumulate_grad_hooks", None) or {}
        pre = getattr(p, "_backward_hooks", None) or {}
        if any(not isinstance(h, _IncomingAudit) for h in pre.values()) \
                or any(not isinstance(h, _Audit) for h in post.values()):
            raise SpmdUsageError(
                f'backend="spmd": parameter {fqns.get(i, "#" + str(i))!r} has a gradient hook '
                "(register_hook or register_post_accumulate_grad_hook); the Dynamo door cannot "
                "run it where DDP does (on this rank's gradient, before the all-reduce). Use "
                "spmd_backend.compile, which runs parameter hooks as DDP does, or remove the hook"
            )


def changed_global_hooks(at_compile: tuple[tuple[int, ...], ...]) -> list[str]:
    """The global module hook kinds registered or removed since ``at_compile`` (a
    :func:`~spmd_backend.tracing.object_state.global_module_hooks` snapshot). Dynamo does not guard
    them: a graph keeps running the global hooks it was compiled with."""
    now = global_module_hooks()
    return [name.strip("_").replace("_", " ")[:-1]
            for name, old, new in zip(GLOBAL_MODULE_HOOKS, at_compile, now) if old != new]
