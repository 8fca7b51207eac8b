"""Find the module and optimizer of a train-step call and describe its live state.

:class:`StepBinding` is built on every call from the live objects: it validates the call (one
module, at most one optimizer, optimizer parameters belong to the module), lists the state that
gets lifted to graph inputs (unique parameters, unique buffers, optimizer state, lifted
hyper-parameters, existing gradients, tensor arguments), and computes the :class:`StepKey` that
decides whether a cached graph may be reused. It never mutates anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from spmd_backend.errors import SpmdUsageError

#: Optimizer hyper-parameters that become graph inputs (float values are wrapped in a tensor).
LIFTED_HYPERPARAMETERS: tuple[str, ...] = ("lr",)


def _tensor_spec(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.dtype, t.device, t.requires_grad)


def _hashable(value: Any) -> Any:
    if isinstance(value, (bool, int, float, str, type(None), torch.dtype, torch.device)):
        return value
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, torch.Tensor):
        return ("tensor",) + _tensor_spec(value)
    return ("object", type(value).__qualname__, id(value))


#: attribute ``mark_dynamic`` sets on a tensor: the dims traced symbolically
DYNAMIC_DIMS_ATTR = "_spmd_dynamic_dims"


def mark_dynamic(t: torch.Tensor, dims: int | Sequence[int] = 0) -> torch.Tensor:
    """Trace ``dims`` of ``t`` symbolically: another size there reuses the compiled graph.

    Sizes 0 and 1 stay specialized (like torch.compile's), so a graph traced for a batch of 8
    serves every batch of 2 or more. Returns ``t``.
    """
    dims = [dims] if isinstance(dims, int) else list(dims)
    for d in dims:
        if not -t.dim() <= d < t.dim():
            raise SpmdUsageError(f"mark_dynamic: dim {d} out of range for a {t.dim()}-d tensor")
    setattr(t, DYNAMIC_DIMS_ATTR, {d % t.dim() for d in dims})
    return t


def dynamic_dims(t: torch.Tensor, batch_dim_dynamic: bool) -> set[int]:
    """The dims of an argument tensor traced symbolically."""
    dims = set(getattr(t, DYNAMIC_DIMS_ATTR, ()))
    if batch_dim_dynamic and t.dim() > 0:
        dims.add(0)
    return dims


def _leaf_key(leaf: Any, batch_dim_dynamic: bool = False) -> Any:
    if isinstance(leaf, torch.Tensor):
        dyn = dynamic_dims(leaf, batch_dim_dynamic)
        if dyn:
            shape = tuple(
                (("dyn", s if s < 2 else ">=2") if i in dyn else s) for i, s in enumerate(leaf.shape)
            )
            return ("tensor", shape, leaf.dtype, leaf.device, leaf.requires_grad)
        return ("tensor",) + _tensor_spec(leaf)
    if isinstance(leaf, nn.Module):
        return ("module", id(leaf))
    if isinstance(leaf, torch.optim.Optimizer):
        return ("optimizer", id(leaf))
    return ("const", _hashable(leaf))


@dataclass(frozen=True)
class StepKey:
    """Everything a traced graph bakes in; a different key means a retrace."""

    module: int
    optimizer: int | None
    params: tuple
    grads: tuple
    buffers: tuple
    groups: tuple
    state: tuple
    args_spec: Any
    args: tuple

    def explain(self, other: StepKey, binding: StepBinding | None = None) -> str:
        """A one-line reason why ``other`` (the new call) cannot reuse this key's graph."""
        for f in fields(self):
            old, new = getattr(self, f.name), getattr(other, f.name)
            if old == new:
                continue
            if f.name == "args" and binding is not None and len(old) == len(new):
                paths = binding.arg_paths()
                for i, (a, b) in enumerate(zip(old, new)):
                    if a != b:
                        return f"argument {paths[i]} changed from {_fmt(a)} to {_fmt(b)}"
            if f.name in ("params", "grads", "buffers", "state") and binding is not None:
                names = (
                    binding.buffer_names if f.name == "buffers" else binding.param_names
                )
                if len(old) == len(new):
                    for i, (a, b) in enumerate(zip(old, new)):
                        if a != b:
                            what = {"params": "parameter", "grads": "gradient of",
                                    "buffers": "buffer", "state": "optimizer state of"}[f.name]
                            return f"{what} {names[i][0]!r} changed from {_fmt(a)} to {_fmt(b)}"
                return f"the module's {f.name} changed (count {len(old)} -> {len(new)})"
            labels = {
                "module": "a different module was passed",
                "optimizer": "a different optimizer was passed",
                "groups": "optimizer param groups or hyper-parameters changed",
                "args_spec": "the structure of the arguments changed",
            }
            return labels.get(f.name, f"{f.name} changed")
        return "no difference"


def _fmt(spec: Any) -> str:
    if isinstance(spec, tuple) and spec and spec[0] == "tensor":
        shape, dtype, device, rg = spec[1:]
        dims = [d[1] if isinstance(d, tuple) else d for d in shape]
        return f"tensor(shape={dims}, dtype={dtype}, device={device}, requires_grad={rg})"
    if spec is None:
        return "None"
    return repr(spec)


@dataclass
class StepBinding:
    """The live objects of one train-step call, validated and indexed."""

    module: nn.Module
    optimizer: torch.optim.Optimizer | None
    params: list[nn.Parameter]
    param_names: list[tuple[str, ...]]
    buffers: list[torch.Tensor]
    buffer_names: list[tuple[str, ...]]
    flat_args: list[Any]
    args_spec: Any
    args: tuple
    kwargs: dict
    batch_dim_dynamic: bool = False

    @classmethod
    def from_call(cls, args: tuple, kwargs: dict, batch_dim_dynamic: bool = False) -> StepBinding:
        flat, spec = pytree.tree_flatten((args, kwargs))
        modules: list[nn.Module] = []
        optims: list[torch.optim.Optimizer] = []
        for leaf in flat:
            if isinstance(leaf, nn.Module) and not any(leaf is m for m in modules):
                modules.append(leaf)
            elif isinstance(leaf, torch.optim.Optimizer) and not any(leaf is o for o in optims):
                optims.append(leaf)
        if not modules:
            raise SpmdUsageError(
                "spmd_backend.compile: the train step received no torch.nn.Module; pass the "
                "model as an argument, e.g. train_step(model, optim, batch)"
            )
        if len(modules) > 1:
            kinds = ", ".join(type(m).__name__ for m in modules)
            raise SpmdUsageError(
                f"spmd_backend.compile: the train step received {len(modules)} modules ({kinds}); "
                "exactly one is supported. Wrap them in one parent nn.Module."
            )
        if len(optims) > 1:
            kinds = ", ".join(type(o).__name__ for o in optims)
            raise SpmdUsageError(
                f"spmd_backend.compile: the train step received {len(optims)} optimizers ({kinds}); "
                "at most one is supported. Use one optimizer with several param groups."
            )
        module = modules[0]
        optimizer = optims[0] if optims else None

        params, param_names = _unique_named(module.named_parameters(remove_duplicate=False))
        buffers, buffer_names = _unique_named(module.named_buffers(remove_duplicate=False))
        index = {id(p): i for i, p in enumerate(params)}
        devices = sorted({str(p.device) for p in params})
        if len(devices) > 1:
            raise SpmdUsageError(
                f"spmd_backend.compile: the parameters of {type(module).__name__} are on several "
                f"devices ({', '.join(devices)}); data parallelism needs one device per rank"
            )

        if optimizer is not None:
            if not any(g["params"] for g in optimizer.param_groups):
                raise SpmdUsageError(
                    f"spmd_backend.compile: {type(optimizer).__name__} holds no parameters"
                )
            for g, group in enumerate(optimizer.param_groups):
                for j, p in enumerate(group["params"]):
                    if id(p) not in index:
                        raise SpmdUsageError(
                            f"spmd_backend.compile: {type(optimizer).__name__} param_groups[{g}]"
                            f"['params'][{j}] (shape {list(p.shape)}) is not a parameter of the "
                            f"module {type(module).__name__}; the optimizer must hold only the "
                            "module's parameters"
                        )
        return cls(
            module=module,
            optimizer=optimizer,
            params=params,
            param_names=param_names,
            buffers=buffers,
            buffer_names=buffer_names,
            flat_args=flat,
            args_spec=spec,
            args=args,
            kwargs=kwargs,
            batch_dim_dynamic=batch_dim_dynamic,
        )

    # ------------------------------------------------------------------ derived views
    def param_index(self) -> dict[int, int]:
        return {id(p): i for i, p in enumerate(self.params)}

    def arg_paths(self) -> list[str]:
        leaves, _ = pytree.tree_flatten_with_path((self.args, self.kwargs))
        out = []
        for path, _leaf in leaves:
            text = pytree.keystr(path)
            # ((args), {kwargs}) -> "args[0]" / "kwargs['x']"
            if text.startswith("[0]"):
                text = "args" + text[3:]
            elif text.startswith("[1]"):
                text = "kwargs" + text[3:]
            out.append(text)
        return out

    def key(self) -> StepKey:
        opt = self.optimizer
        idx = self.param_index()
        groups: tuple = ()
        state: tuple = ()
        if opt is not None:
            groups = tuple(
                (
                    tuple(idx[id(p)] for p in g["params"]),
                    tuple(
                        (k, "lifted" if k in LIFTED_HYPERPARAMETERS else _hashable(v))
                        for k, v in sorted(g.items())
                        if k != "params"
                    ),
                )
                for g in opt.param_groups
            )
            state = tuple(
                None
                if p not in opt.state
                else tuple((k, _hashable(v)) for k, v in sorted(opt.state[p].items(), key=_item_key))
                for p in self.params
            )
        return StepKey(
            module=id(self.module),
            optimizer=id(opt) if opt is not None else None,
            params=tuple((id(p),) + _tensor_spec(p) for p in self.params),
            grads=tuple(None if p.grad is None else _tensor_spec(p.grad) for p in self.params),
            buffers=tuple((id(b),) + _tensor_spec(b) for b in self.buffers),
            groups=groups,
            state=state,
            args_spec=self.args_spec,
            args=tuple(_leaf_key(leaf, self.batch_dim_dynamic) for leaf in self.flat_args),
        )


def _unique_named(named: Any) -> tuple[list[Any], list[tuple[str, ...]]]:
    """Unique tensors (by identity, first-seen order) with every name each one has."""
    tensors: list[Any] = []
    names: list[list[str]] = []
    index: dict[int, int] = {}
    for name, t in named:
        if t is None:
            continue
        i = index.get(id(t))
        if i is None:
            index[id(t)] = len(tensors)
            tensors.append(t)
            names.append([name])
        else:
            names[i].append(name)
    return tensors, [tuple(n) for n in names]


def _item_key(kv: tuple[Any, Any]) -> str:
    return str(kv[0])
