"""Find the module and optimizer of a train-step call and describe its live state.

:class:`StepBinding` is built on every call from the live objects: it validates the call (one
module, at most one optimizer, optimizer parameters belong to the module), lists the state that
gets lifted to graph inputs (unique parameters, unique buffers, optimizer state, lifted
hyper-parameters, existing gradients, tensor arguments), and computes the
:class:`~spmd_backend.tracing.key.StepKey` that decides, with the graph's guards, whether a
cached graph may be reused. ``UserDict`` arguments (transformers' ``BatchEncoding``) are seen as
mappings. It never mutates anything.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import GetAttrKey

from spmd_backend.errors import SpmdUsageError
from spmd_backend.tracing.buffer_views import find_buffer_views
from spmd_backend.tracing.free_values import free_values, step_defaults
from spmd_backend.tracing.hyperparams import HyperSlot, lifted_slots
from spmd_backend.tracing.key import StepKey, global_context, layout
from spmd_backend.tracing.object_state import (
    module_state,
    optimizer_attributes,
    optimizer_state_hooks,
    plain_attributes,
)
from spmd_backend.tracing.tracked import adapt_user_dicts, tree_key_path
from spmd_backend.tracing.values import hashable, tensor_spec

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


@dataclass
class StepBinding:
    """The live objects of one train-step call, validated and indexed."""

    module: nn.Module
    optimizer: torch.optim.Optimizer | None
    params: list[nn.Parameter]
    param_names: list[tuple[str, ...]]
    buffers: list[torch.Tensor]
    buffer_names: list[tuple[str, ...]]
    #: ``(fqn, module)`` of every submodule, once each (``named_modules()`` order)
    modules: list[tuple[str, nn.Module]]
    flat_args: list[Any]
    args_spec: Any
    args: tuple
    kwargs: dict
    leaf_paths: list[tuple[Any, ...]]
    #: non-tensor leaves inside argument dicts: keyed only if the trace reads them
    tracked_leaves: frozenset[int]
    hyper_slots: list[HyperSlot]
    #: param groups traced single-tensor although fused by default (see hyperparams.unfusing_lifts)
    unfused_groups: frozenset[int] = frozenset()
    #: objects besides the module and optimizer whose tensors the step uses (GradScalers)
    aux_objects: list[Any] = field(default_factory=list)
    batch_dim_dynamic: bool = False
    #: the step function (its globals and closure are part of the key)
    fn: Any = None
    #: ``(args, kwargs)`` as the caller passed them (``args``/``kwargs`` above are rebuilt
    #: copies): where a replayed write to an argument dict lands
    original: tuple = ((), {})

    @classmethod
    def from_call(
        cls, args: tuple, kwargs: dict, batch_dim_dynamic: bool = False,
        fn: Any = None, unfused: dict[int, frozenset[int]] | None = None,
    ) -> StepBinding:
        """Bind a call. ``unfused`` maps an optimizer's id to the param groups traced with
        their single-tensor implementation instead of the fused default."""
        original = (args, kwargs)
        args, kwargs = adapt_user_dicts((args, kwargs))
        with_paths, spec = pytree.tree_flatten_with_path((args, kwargs))
        flat = [leaf for _, leaf in with_paths]
        paths = [tree_key_path(path) for path, _ in with_paths]
        args, kwargs = pytree.tree_unflatten(flat, spec)
        module, optimizer = _module_and_optimizer(flat, fn)
        unfused_groups = (unfused or {}).get(id(optimizer), frozenset())
        # one walk of the module tree serves parameters, buffers and the key's module state
        # (named_parameters/named_buffers would walk it again each)
        walk = list(module.named_modules(remove_duplicate=False))
        # a module registered twice (``Sequential(block, act, block)``) is one module: naming its
        # tensors twice made the trace's swap save its own stand-in as the original under the
        # second name, and the stand-ins stayed in the module after the call
        unique = _unique_modules(walk)
        params, param_names = _unique_named(_members(unique, "_parameters"))
        buffers, buffer_names = _unique_named(_members(unique, "_buffers"))
        _check_initialized(params + buffers, param_names + buffer_names)
        _check_grad_shapes(params, param_names)
        _check_state(module, optimizer, params)
        tracked = frozenset(
            j for j, (leaf, path) in enumerate(zip(flat, paths))
            if _is_trackable(leaf) and any(isinstance(e, tuple) and e[:1] == ("map",) for e in path)
            # below a dataclass field the trace reads attributes, not dict entries: keyed always
            and not any(isinstance(e, GetAttrKey) for e in path)
        )
        return cls(
            module=module,
            optimizer=optimizer,
            params=params,
            param_names=param_names,
            buffers=buffers,
            buffer_names=buffer_names,
            modules=unique,
            flat_args=flat,
            args_spec=spec,
            args=args,
            kwargs=kwargs,
            leaf_paths=paths,
            tracked_leaves=tracked,
            hyper_slots=lifted_slots(optimizer, unfused_groups),
            unfused_groups=unfused_groups,
            aux_objects=find_grad_scalers(flat, fn),
            batch_dim_dynamic=batch_dim_dynamic,
            fn=fn,
            original=original,
        )

    # ------------------------------------------------------------------ derived views
    def param_index(self) -> dict[int, int]:
        return {id(p): i for i, p in enumerate(self.params)}

    def _buffer_views(self) -> tuple:
        """The key's map of buffers that are views of others; raises for sharing a trace cannot
        reproduce, an argument sharing a buffer's or parameter's memory included."""
        return find_buffer_views(self.buffers, self.buffer_names, self.params, self.param_names,
                                 self.flat_args, self.arg_paths)

    def arg_paths(self) -> list[str]:
        """Each flat argument leaf's path as the user wrote it (``args[2]['input_ids']``)."""
        out = []
        for path in self.leaf_paths:
            text = "".join(
                f"[{e[1]!r}]" if isinstance(e, tuple)
                else f".{e.name}" if isinstance(e, GetAttrKey) else f"[{e.idx}]"
                for e in path[1:]
            )
            out.append(("args" if path and path[0].idx == 0 else "kwargs") + text)
        return out

    def aux_attributes(self, o: int) -> tuple[str, ...]:
        """The tensor attributes of auxiliary object ``o`` that become graph inputs."""
        obj = self.aux_objects[o]
        return tuple(a for a in GRAD_SCALER_TENSORS if isinstance(getattr(obj, a, None), torch.Tensor))

    def dims_traced_dynamic(self, j: int) -> set[int]:
        """The dims of tensor argument leaf ``j`` traced symbolically (marked, size >= 2)."""
        leaf = self.flat_args[j]
        dims = dynamic_dims(leaf, self.batch_dim_dynamic)
        return {d for d in dims if leaf.shape[d] >= 2}

    def leaf_key(self, j: int) -> Any:
        leaf = self.flat_args[j]
        if isinstance(leaf, torch.Tensor):
            dyn = self.dims_traced_dynamic(j)
            if dyn:
                shape = tuple(("dyn", ">=2") if i in dyn else s for i, s in enumerate(leaf.shape))
                return ("tensor", shape, leaf.dtype, leaf.device, leaf.requires_grad,
                        layout(leaf, symbolic=True))
            return ("tensor",) + tensor_spec(leaf) + (layout(leaf),)
        if isinstance(leaf, nn.Module):
            return ("module", id(leaf))
        if isinstance(leaf, torch.optim.Optimizer):
            return ("optimizer", id(leaf))
        return ("const", hashable(leaf))

    def free_values(self) -> tuple:
        """The plain values the step function reads from outside its arguments."""
        if self.fn is None:
            return ()
        return free_values(self.fn, self.modules) + step_defaults(self.fn)

    def key(self) -> StepKey:
        opt = self.optimizer
        groups: tuple = ()
        state: tuple = ()
        opt_hooks: tuple = ()
        opt_attrs: tuple = ()
        if opt is not None:
            idx = self.param_index()
            lifted: dict[int, list[tuple[str, int | None]]] = {}
            for g, k, i in self.hyper_slots:
                lifted.setdefault(g, []).append((k, i))
            groups = tuple(
                (tuple(idx[id(p)] for p in g["params"]), tuple(sorted(g, key=str)),
                 tuple(lifted.get(gi, ())), gi in self.unfused_groups)
                for gi, g in enumerate(opt.param_groups)
            )
            live = opt.state
            state = tuple([None if p not in live else _state_key(live[p]) for p in self.params])
            opt_hooks = optimizer_state_hooks(opt)
            opt_attrs = optimizer_attributes(opt)
        return StepKey(
            module=id(self.module),
            optimizer=id(opt) if opt is not None else None,
            params=tuple([(id(p),) + tensor_spec(p) + _tensor_hooks(p) for p in self.params]),
            grads=tuple([None if (g := p.grad) is None else tensor_spec(g) for p in self.params]),
            buffers=tuple([(id(b),) + tensor_spec(b) for b in self.buffers]),
            buffer_views=self._buffer_views(),
            groups=groups,
            state=state,
            optimizer_hooks=opt_hooks,
            optimizer_attrs=opt_attrs,
            args_spec=self.args_spec,
            args=tuple(
                ("tracked",) if j in self.tracked_leaves else self.leaf_key(j)
                for j in range(len(self.flat_args))
            ),
            modules=module_state(self.modules),
            aux=tuple(
                (id(o), plain_attributes(o),
                 tuple(tensor_spec(getattr(o, a)) for a in self.aux_attributes(i)))
                for i, o in enumerate(self.aux_objects)
            ),
            context=global_context(),
            free_values=self.free_values(),
        )


#: a GradScaler's tensors (created lazily by its first ``scale()``)
GRAD_SCALER_TENSORS = ("_scale", "_growth_tracker")


def find_grad_scalers(flat_args: Sequence[Any], fn: Any) -> list[Any]:
    """GradScalers the step receives as arguments or names as globals or closure variables."""
    from torch.amp import GradScaler

    found: list[Any] = []

    def add(obj: Any) -> None:
        if isinstance(obj, GradScaler) and not any(obj is f for f in found):
            found.append(obj)

    for leaf in flat_args:
        add(leaf)
    code = getattr(fn, "__code__", None)
    if code is not None:
        glob = getattr(fn, "__globals__", {})
        for name in code.co_names:
            if name in glob:
                add(glob[name])
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                add(cell.cell_contents)
            except ValueError:  # an empty cell
                continue
    return found


def _is_trackable(leaf: Any) -> bool:
    return not isinstance(leaf, (torch.Tensor, nn.Module, torch.optim.Optimizer))


def _tensor_hooks(p: torch.Tensor) -> tuple:
    hooks = getattr(p, "_backward_hooks", None)
    post = getattr(p, "_post_accumulate_grad_hooks", None)
    return (tuple(hooks) if hooks else (), tuple(post) if post else ())


def check_optimizer_supported(optimizer: torch.optim.Optimizer) -> None:
    """Refuse optimizers whose step cannot be one graph (closure-driven, data dependent), and
    wrappers that step another optimizer of their own (SAM, Lookahead: the compiled step lifts
    only the given optimizer's state and param groups, so the inner one's momentum would not
    carry over between calls: measured 3% off DDP after four SAM steps)."""
    # an instance exists only if its module was imported; importing it here would cost the
    # first call 0.6 s of TorchScript compiles (torch.distributed.optim's functional optimizers)
    zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    if zero is not None and isinstance(optimizer, zero.ZeroRedundancyOptimizer):
        raise SpmdUsageError(
            "spmd_backend.compile: ZeroRedundancyOptimizer shards the optimizer state through "
            "collectives of its own, which a compiled step does not capture. Pass the optimizer "
            "it wraps, created over all parameters (for example torch.optim.AdamW("
            "model.parameters(), ...)), and compile with DataParallel(shard_optimizer=True): the "
            "compiled step then keeps only this rank's shard of the state, as ZeRO does"
        )
    for name, inner in vars(optimizer).items():
        if isinstance(inner, torch.optim.Optimizer) and inner is not optimizer:
            raise SpmdUsageError(
                f"spmd_backend.compile: {type(optimizer).__name__}.{name} is another optimizer "
                f"({type(inner).__name__}) that the step uses; a step compiled by "
                "spmd_backend.compile carries only the state of the optimizer it is given, so "
                "the inner optimizer's state would not carry over between calls. Compile the "
                'step with torch.compile(step, backend="spmd"), which traces both, or pass the '
                "inner optimizer itself"
            )
    if isinstance(optimizer, torch.optim.LBFGS):
        raise SpmdUsageError(
            "spmd_backend.compile: torch.optim.LBFGS cannot be compiled into a train step: its "
            "step() calls a closure that re-runs forward and backward a data-dependent number "
            "of times (line search, convergence tests on .item() values), which one static graph "
            "cannot express. Use a first-order optimizer (SGD, Adam, AdamW, ...) or run LBFGS "
            "eagerly"
        )


def _held_by_instance(fn: Any) -> list[str]:
    """``Trainer.model``, ``Trainer.opt``: the modules and optimizers a bound method's instance
    holds as attributes (what a trainer-style ``trainer.step(batch)`` reads through ``self``)."""
    owner = getattr(fn, "__self__", None)
    if owner is None or isinstance(owner, nn.Module):
        return []
    held = vars(owner) if hasattr(owner, "__dict__") else {}
    return [f"{type(owner).__name__}.{name}" for name, value in held.items()
            if isinstance(value, (nn.Module, torch.optim.Optimizer))]


def _module_and_optimizer(
    flat: list[Any], fn: Any = None
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """The one module and at most one optimizer among the call's leaves (else a usage error)."""
    modules: list[nn.Module] = []
    optims: list[torch.optim.Optimizer] = []
    for leaf in flat:
        if isinstance(leaf, nn.Module) and not any(leaf is m for m in modules):
            modules.append(leaf)
        elif isinstance(leaf, torch.optim.Optimizer) and not any(leaf is o for o in optims):
            optims.append(leaf)
    if not modules:
        held = _held_by_instance(fn)
        if held:
            raise SpmdUsageError(
                f"spmd_backend.compile: the train step is a method that reads {', '.join(held)} "
                "through self; spmd_backend.compile takes the module and the optimizer as "
                "arguments (a step defined as train_step(model, optim, batch), called as "
                "train_step(self.model, self.opt, batch)), or compile the method with "
                'torch.compile(trainer.step, backend="spmd"), which reads them through self'
            )
        raise SpmdUsageError(
            "spmd_backend.compile: the train step received no torch.nn.Module; pass the "
            "model as an argument, e.g. train_step(model, optim, batch)"
        )
    if len(modules) > 1:
        kinds = ", ".join(type(m).__name__ for m in modules)
        raise SpmdUsageError(
            f"spmd_backend.compile: the train step received {len(modules)} modules ({kinds}); "
            "exactly one is supported. Wrap them in one parent nn.Module, or compile the step "
            'with torch.compile(step, backend="spmd"), which takes any number (a GAN\'s '
            "generator and discriminator with their own optimizers)."
        )
    if len(optims) > 1:
        kinds = ", ".join(type(o).__name__ for o in optims)
        raise SpmdUsageError(
            f"spmd_backend.compile: the train step received {len(optims)} optimizers ({kinds}); "
            "at most one is supported. Use one optimizer with several param groups if they step "
            'together, or compile the step with torch.compile(step, backend="spmd"), which takes '
            "any number (a GAN's two optimizers stepping after their own backward)."
        )
    if isinstance(modules[0], DistributedDataParallel):
        # its forward drives DDP's reducer, whose hooks sit on the real parameters (the trace
        # runs on stand-ins): a second trace (a retrace) failed inside DDP
        raise SpmdUsageError(
            "spmd_backend.compile: the train step received a module wrapped in "
            f"DistributedDataParallel ({type(modules[0].module).__name__}); the compiled step "
            "reduces the gradients itself. Pass the bare module (ddp_model.module, or the model "
            "before wrapping it)"
        )
    optimizer = optims[0] if optims else None
    if optimizer is not None:
        check_optimizer_supported(optimizer)
    return modules[0], optimizer


def _check_initialized(tensors: list[torch.Tensor], names: list[tuple[str, ...]]) -> None:
    """A lazy module's parameters and buffers take their shape in its first forward."""
    lazy = [n[0] for t, n in zip(tensors, names) if nn.parameter.is_lazy(t)]
    if lazy:
        raise SpmdUsageError(
            f"spmd_backend.compile: {', '.join(lazy)} are not initialized yet (a lazy module, "
            "torch.nn.LazyLinear and friends, sizes them in its first forward). Run one "
            "forward on a batch before compiling and before creating the optimizer, as torch "
            "recommends for lazy modules"
        )


def _check_grad_shapes(params: list[nn.Parameter], names: list[tuple[str, ...]]) -> None:
    """A parameter resized in place (transformers' ``resize_token_embeddings``) keeps its old
    ``.grad``; eager never reads it when the step zeroes first, the trace lifts it as an input
    (until 2026-11-28 torch's 'attempting to assign a gradient of size' error; hunt 36)."""
    stale = [
        f"{n[0]} (parameter {list(p.shape)}, .grad {list(p.grad.shape)})"
        for p, n in zip(params, names)
        if p.grad is not None and p.grad.shape != p.shape
    ]
    if stale:
        raise SpmdUsageError(
            f"spmd_backend.compile: the gradient of {', '.join(stale)} has another shape than "
            "its parameter (resized in place, as resize_token_embeddings does). Set the "
            "gradients to None after resizing (model.zero_grad(set_to_none=True)); nothing was "
            "changed"
        )


def _check_state(
    module: nn.Module, optimizer: torch.optim.Optimizer | None, params: list[nn.Parameter]
) -> None:
    """One device for the parameters; the optimizer holds some, and only the module's."""
    devices = sorted({str(p.device) for p in params})
    if len(devices) > 1:
        raise SpmdUsageError(
            f"spmd_backend.compile: the parameters of {type(module).__name__} are on several "
            f"devices ({', '.join(devices)}); data parallelism needs one device per rank"
        )
    if optimizer is None:
        return
    if not any(g["params"] for g in optimizer.param_groups):
        raise SpmdUsageError(f"spmd_backend.compile: {type(optimizer).__name__} holds no parameters")
    index = {id(p) for p in params}
    for g, group in enumerate(optimizer.param_groups):
        for j, p in enumerate(group["params"]):
            if id(p) not in index:
                raise SpmdUsageError(
                    f"spmd_backend.compile: {type(optimizer).__name__} param_groups[{g}]"
                    f"['params'][{j}] (shape {list(p.shape)}) is not a parameter of the "
                    f"module {type(module).__name__}; the optimizer must hold only the "
                    "module's parameters"
                )


def _unique_modules(walk: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    seen: set[int] = set()
    out = []
    for name, mod in walk:
        if id(mod) not in seen:
            seen.add(id(mod))
            out.append((name, mod))
    return out


def _members(walk: list[tuple[str, nn.Module]], kind: str) -> Any:
    """``(qualified name, tensor)`` of every module's ``_parameters``/``_buffers``, in
    ``named_parameters(remove_duplicate=False)`` order."""
    for prefix, mod in walk:
        for name, t in getattr(mod, kind).items():
            yield (f"{prefix}.{name}" if prefix else name), t


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


def _state_key(entry: dict) -> tuple:
    """One parameter's optimizer state in the key: its entries by name, each value hashable."""
    items = list(entry.items())
    if len(items) > 1:
        items.sort(key=_item_key)
    return tuple([(k, hashable(v)) for k, v in items])
