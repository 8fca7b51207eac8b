"""What the frame Dynamo is compiling for the spmd backend reaches (directly, and the modules
and optimizers the objects and containers it reaches hold), the names of its modules'
parameters, and the refusal of a module wrapped in DistributedDataParallel.

Requires: :func:`parameter_names` entered by the scope's frame hook around a frame's compile
(``scope.install``). Guarantees: :func:`parameter_name` answers only while that frame is
compiled (None otherwise), from the modules among :func:`frame_values`; a parameter held by
several modules is named by the first.
"""

from __future__ import annotations

import contextlib
import itertools
import types
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from spmd_backend.errors import SpmdUsageError

_names: list[dict[int, str]] = []


def frame_values(code: Any, frame_locals: Any, frame_globals: Any, closure: Any) -> list[Any]:
    """What a frame reaches directly, in this order: arguments and locals, closure cells and
    the globals its code names; then the modules and optimizers those hold (:func:`held`)."""
    values: list[Any] = list(dict(frame_locals or {}).values())
    for cell in closure or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    names = getattr(code, "co_names", ())
    values.extend(frame_globals[n] for n in names if isinstance(frame_globals, dict) and n in frame_globals)
    seen = {id(v) for v in values}
    for owner in held(values, frozenset(names)):
        if id(owner) not in seen:
            seen.add(id(owner))
            values.append(owner)
    return values


_OWNERS = (torch.nn.Module, torch.optim.Optimizer)
_NOT_HOLDERS = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType)
#: items of one container looked at (a container of modules is small; a global list may not be)
_CONTAINER_ITEMS = 64


def _is(value: Any, kinds: tuple[type, ...]) -> bool:
    """``isinstance`` by the real type (a ``Mock(spec=nn.Module)`` claims to be a module)."""
    return issubclass(type(value), kinds)


def _members(value: Any, names: frozenset[str] | None) -> list[Any]:
    """What ``value`` holds one level down: a container's items, or those of an object's
    attributes that ``names`` lists (all when None); nothing for anything else."""
    try:
        if _is(value, (dict,)):
            return list(itertools.islice(value.values(), _CONTAINER_ITEMS))
        if _is(value, (list, tuple)):
            return list(value[:_CONTAINER_ITEMS])
        if _is(value, (*_OWNERS, *_NOT_HOLDERS, torch.Tensor)):
            return []
        attributes = object.__getattribute__(value, "__dict__")
    except Exception:  # noqa: BLE001 - a dead weakref proxy, an object without a __dict__
        return []
    if not _is(attributes, (dict,)):
        return []
    return [v for k, v in attributes.items() if names is None or k in names]


def held(values: Iterable[Any], names: frozenset[str] | None = None) -> Iterator[Any]:
    """The modules and optimizers that ``values`` hold one level down: an attribute of an object
    that the frame's code names (a trainer's ``self.model`` and ``self.opt`` in its compiled
    method: a module the trainer holds for something else is not reached), an item of a
    container, or an item of a container such an attribute holds (``self.models["gen"]``)."""
    for v in values:
        for m in _members(v, names):
            if _is(m, _OWNERS):
                yield m
            elif _is(m, (dict, list, tuple)):
                yield from (x for x in _members(m, None) if _is(x, _OWNERS))


def trainable_parameters(values: Iterable[Any]) -> Iterator[tuple[Any, str, torch.Tensor]]:
    """``(owner, name, parameter)`` for every parameter that requires grad of the modules (named
    by FQN) and optimizers (``param_groups.g.params.i``) among ``values``."""
    for v in values:
        if isinstance(v, torch.nn.Module):
            named = list(v.named_parameters())
        elif isinstance(v, torch.optim.Optimizer):
            named = [(f"param_groups.{g}.params.{i}", p)
                     for g, group in enumerate(v.param_groups) for i, p in enumerate(group["params"])]
        else:
            continue
        yield from ((v, n, p) for n, p in named if p.requires_grad)


def refuse_ddp_wrapper(values: list[Any]) -> Exception | None:
    """The error for a module among ``values`` wrapped in DistributedDataParallel, else None.

    DDP's forward and its reducer's hooks are eager code around the graphs (Dynamo splits the
    step at them), so the gradient audit saw gradients no compiled backward reduced and blamed
    a graph break. backend="spmd" is the data parallelism itself: it wants the bare module.
    """
    from torch.nn.parallel import DistributedDataParallel

    for v in values:
        if isinstance(v, DistributedDataParallel):
            return SpmdUsageError(
                'backend="spmd": the step uses a module wrapped in DistributedDataParallel '
                f"({type(v.module).__name__}); the backend reduces the gradients itself. Pass "
                "the bare module (ddp_model.module, or the model before wrapping it)"
            )
    return None


def refuse_lbfgs(values: list[Any]) -> Exception | None:
    """The error for a ``torch.optim.LBFGS`` among ``values``, else None.

    Its ``step(closure)`` re-runs forward and backward a data-dependent number of times;
    Dynamo splits it into pieces that run partly eagerly, so the step ran its first forward
    and backward, wrote ``.grad`` and LBFGS's state, and then failed on an eager gradient
    without naming the optimizer (hunt 41). Refused before anything of the frame runs, as the
    compile door refuses it."""
    for v in values:
        if _is(v, (torch.optim.LBFGS,)):
            return SpmdUsageError(
                'backend="spmd": torch.optim.LBFGS cannot be compiled into a train step: its '
                "step() calls a closure that re-runs forward and backward a data-dependent "
                "number of times (line search, convergence tests on .item() values). Use a "
                "first-order optimizer (SGD, Adam, AdamW, ...) or run LBFGS eagerly"
            )
    return None


def refuse_lazy_modules(values: list[Any]) -> Exception | None:
    """The error for a module among ``values`` with parameters or buffers a lazy module has not
    sized yet (``nn.LazyLinear`` before its first forward), else None. Dynamo failed inside
    itself on them (an ``InternalTorchDynamoError``, hunt 41); DDP refuses them too."""
    for v in values:
        if not _is(v, (torch.nn.Module,)):
            continue
        lazy = [name for name, t in (*v.named_parameters(), *v.named_buffers())
                if torch.nn.parameter.is_lazy(t)]
        if lazy:
            return SpmdUsageError(
                f'backend="spmd": {", ".join(lazy)} are not initialized yet (a lazy module, '
                "torch.nn.LazyLinear and friends, sizes them in its first forward). Run one "
                "forward on a batch before compiling and before creating the optimizer, as "
                "torch recommends for lazy modules"
            )
    return None


def refuse_frame(values: list[Any], compiler_fn: Any) -> None:
    """Raise the first refusal of a frame reaching ``values``, before anything of it runs, as a
    backend failure (Dynamo passes that through; anything else it reports as its own internal
    error)."""
    refused = refuse_ddp_wrapper(values) or refuse_lbfgs(values) or refuse_lazy_modules(values)
    if refused is not None:
        from torch._dynamo.exc import BackendCompilerFailed

        raise BackendCompilerFailed(compiler_fn, refused, None)


@contextlib.contextmanager
def parameter_names(values: list[Any]) -> Iterator[None]:
    """While a frame is compiled: the FQN of every parameter of the modules among ``values``."""
    names: dict[int, str] = {}
    for v in values:
        if isinstance(v, torch.nn.Module):
            for name, p in v.named_parameters(remove_duplicate=False):
                names.setdefault(id(p), name)
    _names.append(names)
    try:
        yield
    finally:
        _names.pop()


def parameter_name(p: torch.Tensor) -> str | None:
    """The FQN of ``p`` in a module the frame being compiled reaches directly, or None."""
    return _names[-1].get(id(p)) if _names else None
