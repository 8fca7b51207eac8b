"""Create a fresh optimizer's state before Dynamo traces the step that would create it.

A step whose optimizer has no state yet traces differently from every later step (the first
creates ``exp_avg``... inside the graph, the others read them), so Dynamo compiles the whole step
twice: once for the first call, once more when its guard on the empty state fails. For torch's
optimizers whose state starts independent of the gradient's values (the Adam family, RMSprop,
Adamax, NAdam, RAdam, Adadelta, ASGD, Rprop, ...), :func:`create_fresh_state` runs the
optimizer's own ``_init_group`` eagerly, on zero gradients standing in for the ones the step
will compute, so the first trace already reads the state and is the only compile. The state is
exactly what the first eager step would have created (the same code makes it); the one
difference is that a trainable parameter which never receives a gradient also gets an entry.

Eager makes a parameter's state at the parameter's first update, from its group's settings at
that time: Rprop's ``step_size`` is the lr then, ASGD's ``eta`` too. Created here, the state of a
parameter that first gets a gradient some calls later (a second head trained from the third
call, a curriculum) started from the settings of the first call (before 2026-11-28: Rprop 0.34
off DDP after a StepLR halved the lr three times). So a group whose fresh state depends on its
settings (probed once per group: :func:`_made_from_settings`) is left to the step, which then
compiles twice, as SGD's does, and makes each state inside the graph from the settings of its
call, an lr the step itself writes included. Sharding needs every state before the trace: there
such entries are created too, and :func:`keep_fresh` tracks them until their parameter is first
updated; :func:`refresh` (the backend calls it before each call of a graph) remakes a tracked
entry in place, as a shard, when its group's settings changed since it was made (a setting the
step writes itself before a late parameter's first update is the one case it cannot see). An
entry is dropped from tracking at its parameter's first update, or when the optimizer, the
parameter or the entry (``load_state_dict``) is gone.

Requires: called while no frame is being traced (``scope.install``'s frame hook calls it before
Dynamo traces a frame for the spmd backend). Guarantees: only optimizers with no state for any
parameter of a group are touched; a parameter's ``.grad`` is as before afterwards;
:func:`remove_state` undoes the creation exactly (the hook calls it when the compile fails).
SGD creates its momentum buffer from the first gradient's value and is left alone (its first
step compiles twice, as in the compile door's bootstrap); optimizers that are not torch.optim
classes are left alone.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import logging
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from spmd_backend.dynamo import frame
from spmd_backend.tracing.sharding import ShardSpec

log = logging.getLogger(__name__)

#: optimizers whose first state depends on the first gradient's values, not only its shape
_VALUE_DEPENDENT = frozenset({"SGD"})


def _torch_optimizer(obj: Any) -> bool:
    cls = type(obj)
    return (
        isinstance(obj, torch.optim.Optimizer)
        and cls.__module__.startswith("torch.optim")
        and cls.__name__ not in _VALUE_DEPENDENT
        and callable(getattr(cls, "_init_group", None))
    )


def optimizers_of_frame(code: Any, frame_locals: Any, frame_globals: Any, closure: Any) -> list[Any]:
    """The torch.optim optimizers a frame reaches directly (:func:`frame.frame_values`)."""
    found: dict[int, Any] = {}
    for v in frame.frame_values(code, frame_locals, frame_globals, closure):
        if _torch_optimizer(v):
            found.setdefault(id(v), v)
    return list(found.values())


def _fresh_groups(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [
        g for g in opt.param_groups
        if not any(p in opt.state for p in g["params"])
        and any(p.requires_grad for p in g["params"])
    ]


def create_fresh_state(optimizers: Iterable[torch.optim.Optimizer],
                       settings_dependent: bool = False) -> list[tuple[Any, Any]]:
    """Run ``_init_group`` of every fresh param group of the torch.optim optimizers among
    ``optimizers`` on zero stand-in gradients; returns the ``(optimizer, parameter)`` entries
    created. A group whose fresh state depends on its settings (Rprop's, ASGD's lr) is left
    to the step unless ``settings_dependent`` (sharding needs the state before the trace)."""
    created: list[tuple[Any, Any]] = []
    for opt in optimizers:
        groups = _fresh_groups(opt) if _torch_optimizer(opt) else []
        if not settings_dependent:
            groups = [g for g in groups if not _made_from_settings(opt, g)]
        if not groups:
            continue
        for group in groups:
            trainable = [p for p in group["params"] if p.requires_grad]
            _init_group(opt, group, trainable)
            created.extend((opt, p) for p in trainable if p in opt.state)
        log.info('backend="spmd": created the state of a fresh %s before tracing (one compile '
                 "instead of two)", type(opt).__name__)
    return created


def _init_group(opt: torch.optim.Optimizer, group: dict[str, Any], params: list[Any]) -> None:
    """The optimizer's own ``_init_group`` on ``group``, with zero gradients standing in for
    the missing ones of ``params``; every ``.grad`` is as before afterwards."""
    n_lists = len(inspect.signature(type(opt)._init_group).parameters) - 2  # self, group
    standing_in = [p for p in params if p.grad is None]
    try:
        with torch.no_grad():
            for p in standing_in:
                p.grad = torch.zeros_like(p)
            type(opt)._init_group(opt, group, *[[] for _ in range(n_lists)])
    finally:
        for p in standing_in:
            p.grad = None


def remove_state(created: Iterable[tuple[Any, Any]]) -> None:
    """Undo :func:`create_fresh_state`."""
    for opt, p in created:
        opt.state.pop(p, None)


@dataclasses.dataclass
class _Tracked:
    """A state entry created here whose parameter has not been updated yet."""

    optimizer: weakref.ref
    param: weakref.ref
    #: ``id`` of the parameter's state dict when it was made (``load_state_dict`` replaces it;
    #: an id, not the dict: tracking must not keep an optimizer's state alive)
    entries: int
    #: the group's settings the entry was last made from (:func:`_settings`)
    made_from: tuple
    spec: ShardSpec | None


_TRACKED: list[_Tracked] = []


def _group_of(opt: torch.optim.Optimizer, p: torch.Tensor) -> dict[str, Any] | None:
    return next((g for g in opt.param_groups if any(q is p for q in g["params"])), None)


def _setting(value: Any) -> Any:
    if isinstance(value, torch.Tensor):  # lr=torch.tensor(...): changed in place
        return tuple(value.detach().flatten().tolist()) if value.numel() <= 64 else id(value)
    return value if isinstance(value, (bool, int, float, str, type(None))) else repr(value)


def _settings(group: dict[str, Any]) -> tuple:
    return tuple((k, _setting(v)) for k, v in group.items() if k != "params")


def keep_fresh(created: Iterable[tuple[Any, Any]], spec: ShardSpec | None) -> None:
    """Track the entries :func:`create_fresh_state` made for a frame that compiled (``spec``:
    the frame's sharding, if on) until their parameters are first updated; an optimizer
    whose fresh state its settings do not change (the Adam family's zeros) is not tracked."""
    depends: dict[int, bool] = {}
    for opt, p in created:
        entries, group = opt.state.get(p), _group_of(opt, p)
        if entries and group is not None and not _updated(entries):
            if id(group) not in depends:
                depends[id(group)] = _made_from_settings(opt, group)
            if depends[id(group)]:
                _TRACKED.append(_Tracked(weakref.ref(opt), weakref.ref(p), id(entries),
                                         _settings(group), spec))


def _updated(entries: dict[str, Any]) -> bool:
    """Whether the optimizer has stepped this parameter (every torch.optim state counts
    ``step``; without one, it cannot be told, and the entry is left to the optimizer)."""
    step = entries.get("step")
    if isinstance(step, torch.Tensor):
        return bool(step.detach().cpu().ne(0).any())
    return step is None or step != 0


def refresh() -> None:
    """Remake, in place, each tracked entry whose parameter is not updated yet and whose
    group's settings changed since it was made, as the optimizer would make it now."""
    if not _TRACKED:
        return
    still: list[_Tracked] = []
    for t in _TRACKED:
        opt, p = t.optimizer(), t.param()
        entries = opt.state.get(p) if opt is not None and p is not None else None
        if entries is None or id(entries) != t.entries or _updated(entries):
            continue
        group = _group_of(opt, p)
        if group is None:
            continue
        settings = _settings(group)
        if settings != t.made_from:
            _remake(opt, group, p, entries, t.spec)
            log.info('backend="spmd": remade the fresh %s state of a parameter not updated yet '
                     "from its group's new settings", type(opt).__name__)
            t.made_from = settings
        still.append(t)
    _TRACKED[:] = still


def _made(opt: torch.optim.Optimizer, group: dict[str, Any], p: torch.Tensor) -> dict[str, Any]:
    """The state ``_init_group`` makes for ``p`` from ``group``'s settings, leaving the
    optimizer's own state as it was."""
    live, opt.state = opt.state, collections.defaultdict(dict)
    try:
        _init_group(opt, {**group, "params": [p]}, [p])
        return opt.state.get(p, {})
    finally:
        opt.state = live


def _moved(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor)):
        return value
    return value * 0.5 + 0.125


def _made_from_settings(opt: torch.optim.Optimizer, group: dict[str, Any]) -> bool:
    """Whether the fresh state depends on the group's numeric settings: made for a small
    stand-in parameter from the settings as they are and with every number moved."""
    probe = torch.nn.Parameter(torch.zeros(2, dtype=group["params"][0].dtype))
    try:
        a = _made(opt, group, probe)
        b = _made(opt, {k: _moved(v) for k, v in group.items()}, probe)
    except Exception:  # cannot be told: tracked
        log.debug("fresh state of %s not probed", type(opt).__name__, exc_info=True)
        return True
    return a.keys() != b.keys() or any(
        not (torch.equal(v, b[k]) if isinstance(v, torch.Tensor) else v == b[k])
        for k, v in a.items()
    )


def _remake(opt: torch.optim.Optimizer, group: dict[str, Any], p: torch.Tensor,
            entries: dict[str, Any], spec: ShardSpec | None) -> None:
    """Overwrite ``entries`` (``p``'s state, or this rank's shard of it) with what
    ``_init_group`` makes from ``group`` now, in place, so the compiled graphs that read these
    tensors read the new values. torch.optim's fresh state is constant per tensor (zeros, the
    lr, 1): it is made for a two-element stand-in and filled in, without allocating ``p``'s size
    on every call; a state that is not constant is made at full size (and sharded)."""
    probe = torch.nn.Parameter(torch.zeros(2, dtype=p.dtype, device=p.device))
    made = _made(opt, group, probe)
    constant = all(not isinstance(v, torch.Tensor) or v.dim() == 0 or bool((v == v.flatten()[0]).all())
                   for v in made.values())
    if any(isinstance(v, torch.Tensor) and v.dim() and k not in entries for k, v in made.items()):
        constant = False  # a key the settings add (amsgrad's) is made at full size
    if not constant:
        made = _made(opt, group, p)
    sharded = spec is not None and spec.shards(p)
    with torch.no_grad():
        for k, new in made.items():
            old = entries.get(k)
            if isinstance(new, torch.Tensor) and new.dim() and not constant and sharded:
                new = spec.shard_of(new)
            if not isinstance(new, torch.Tensor) or not isinstance(old, torch.Tensor):
                entries[k] = new  # a key Dynamo's guard on the keys sees: it recompiles
            elif constant and new.dim():
                old.fill_(new.flatten()[0])
            elif old.shape == new.shape:
                old.copy_(new)


__all__ = ["create_fresh_state", "keep_fresh", "optimizers_of_frame", "refresh", "remove_state"]
