"""Trace a whole train step (forward, backward, optimizer step, zero_grad) into one fx graph.

Requires: a :class:`~spmd_backend.tracing.binding.StepBinding` of the call (one module, at most
one optimizer). Guarantees: the returned :class:`TracedStep` holds a functional aten-level
``fx.GraphModule`` with flat tensor inputs and a flat output list, traced under fake tensors (no
real compute), whose inputs are, in order::

    params | buffers | optimizer state | lifted hyper-parameters | existing .grad | tensor args

and whose outputs are::

    user-returned tensors | optimizer state created or replaced by the step | final .grad values

Writes to inputs (parameter and state updates, BatchNorm statistics, in-place accumulation into
an existing .grad) are ``aten.copy_`` nodes into the placeholders at the end of the graph, so
running the graph on the real tensors updates them in place. Every parameter gradient passes
through a ``spmd_backend::grad_ready`` marker where it becomes final (a post-accumulate-grad
hook); with ``mark_buffers`` every buffer passes through ``spmd_backend::buffer_sync`` before the
step reads it. Every node carries a phase annotation (:mod:`spmd_backend.graph.meta`).

The optimizer is traced in its capturable, tensor-lr form (``torch.compiler.is_compiling()`` is
reported true while ``step()`` runs): no ``.item()`` on step counts and the learning rate is a
graph input, so an LR scheduler is honoured without retracing. The user's module and optimizer
are swapped back in a ``finally`` block whatever happens.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.utils import stateless

from spmd_backend.errors import SpmdTraceError, SpmdUsageError
from spmd_backend.graph.utils import lazy_graph_modules
from spmd_backend.tracing.annotate import ModuleAnnotator, annotate_optimizer_fqns
from spmd_backend.tracing.binding import StepBinding
from spmd_backend.tracing.dispatch import TraceContext, TraceMode
from spmd_backend.tracing.finish import finish_graph
from spmd_backend.tracing.layout import StepLayout, plan_inputs
from spmd_backend.tracing.markers import BUFFER_SYNC, GRAD_READY
from spmd_backend.tracing.optimizer_swap import optimizer_swapped
from spmd_backend.tracing.overrides import Override, swapped_submodules

log = logging.getLogger(__name__)

_CONST_TYPES = (bool, int, float, complex, str, type(None), torch.dtype, torch.device)



@dataclass
class TracedStep:
    """A traced train step: the graph, its input/output layout and how long tracing took."""

    gm: fx.GraphModule
    layout: StepLayout
    trace_seconds: float
    placeholder_names: list[str]


def _to_fun(t: torch.Tensor) -> torch.Tensor:
    return FunctionalTensor.to_functional(t)


def _from_fun(t: torch.Tensor) -> torch.Tensor:
    torch._sync(t)
    return torch._from_functional_tensor(t.elem)


def _is_fun(t: object) -> bool:
    return isinstance(t, FunctionalTensor)



def _check_output_leaf(leaf: Any, path: str) -> None:
    if isinstance(leaf, torch.Tensor) or isinstance(leaf, _CONST_TYPES):
        return
    raise SpmdUsageError(
        f"spmd_backend.compile: the train step returned a value of type "
        f"{type(leaf).__qualname__} at {path}; a compiled step may return tensors, None, Python "
        "numbers/strings, or (nested) tuples, lists and dicts of them"
    )


def trace_train_step(
    fn: Callable[..., Any],
    binding: StepBinding,
    *,
    mark_buffers: bool = False,
    overrides: Sequence[Override] = (),
    recompile: bool = True,
) -> TracedStep:
    """Trace one call of ``fn`` (bound by ``binding``) into a :class:`TracedStep`.

    ``recompile=False`` leaves ``gm.code`` stale (the graph itself is final) for a caller that
    edits the graph further and recompiles once; regenerating code is a large share of the
    trace time of big graphs.
    """
    t0 = time.perf_counter()
    layout, real_inputs = plan_inputs(binding)
    module: nn.Module = binding.module
    opt = binding.optimizer
    params = binding.params
    index = binding.param_index()
    n_p, n_b = layout.n_params, layout.n_buffers
    n_s, n_h, n_g = len(layout.state_inputs), len(layout.hyper_inputs), len(layout.grad_inputs)
    opt_state_before = {
        i: {k: v for k, v in opt.state[p].items()}
        for i, p in enumerate(params)
        if opt is not None and p in opt.state
    }
    annotator = ModuleAnnotator(module)
    ctx = TraceContext(fqn_provider=annotator.fqn, phase_provider=annotator.phase)
    saw_backward = [False]

    def step(*flat: torch.Tensor) -> list[torch.Tensor]:
        p_in = flat[:n_p]
        b_in = flat[n_p : n_p + n_b]
        s_in = flat[n_p + n_b : n_p + n_b + n_s]
        h_in = flat[n_p + n_b + n_s : n_p + n_b + n_s + n_h]
        g_in = flat[n_p + n_b + n_s + n_h : n_p + n_b + n_s + n_h + n_g]
        a_in = flat[n_p + n_b + n_s + n_h + n_g :]
        with FunctionalTensorMode(_allow_token_discovery=True), TraceMode(ctx):
            f_params = [
                _to_fun(t).requires_grad_(p.requires_grad) for t, p in zip(p_in, params)
            ]
            f_bufs = [_to_fun(t) for t in b_in]
            f_states = [_to_fun(t) for t in s_in]
            f_hyper_list = [_to_fun(t) for t in h_in]
            f_grads = [_to_fun(t) for t in g_in]
            f_args = [_to_fun(t) for t in a_in]
            for i, g in zip(layout.grad_inputs, f_grads):
                f_params[i].grad = g
            # optimizer state: lifted tensors, other values as they are
            f_state: dict[int, dict[str, Any]] = {i: dict(v) for i, v in opt_state_before.items()}
            for (i, k), t in zip(layout.state_inputs, f_states):
                f_state[i][k] = t
            f_hyper: dict[tuple[int, str], torch.Tensor] = {}
            for (g, k), t in zip(layout.hyper_inputs, f_hyper_list):
                # A grad-requiring tensor makes every torch optimizer use tensor arithmetic for
                # the lr instead of `.item()`; the step runs under no_grad, so nothing is
                # recorded for it.
                if t.is_floating_point():
                    t.requires_grad_(True)
                f_hyper[(g, k)] = t
            mapping: dict[str, torch.Tensor] = {}
            for names, fp in zip(binding.param_names, f_params):
                for n in names:
                    mapping[n] = fp
            for names, fb in zip(binding.buffer_names, f_bufs):
                for n in names:
                    mapping[n] = fb

            hooks = []
            for names, fp in zip(binding.param_names, f_params):
                if not fp.requires_grad:
                    continue

                def mark(param: torch.Tensor, _name: str = names[0]) -> None:
                    saw_backward[0] = True
                    param.grad = GRAD_READY(param.grad, _name)

                hooks.append(fp.register_post_accumulate_grad_hook(mark))

            leaves = list(binding.flat_args)
            for j, fa in zip(layout.arg_inputs, f_args):
                leaves[j] = fa
            args, kwargs = pytree.tree_unflatten(leaves, binding.args_spec)
            opt_cm = (
                optimizer_swapped(opt, f_params, index, f_state, f_hyper, ctx)
                if opt is not None
                else contextlib.nullcontext(None)
            )
            try:
                with stateless._reparametrize_module(module, mapping, tie_weights=True), \
                        opt_cm as traced_state:
                    if mark_buffers:
                        for names, fb in zip(binding.buffer_names, f_bufs):
                            fb.copy_(BUFFER_SYNC(fb, names[0]))
                    out = fn(*args, **kwargs)
            finally:
                for h in hooks:
                    h.remove()

        # ---- outputs (outside the functional mode: plain proxies from here on)
        out_leaves_with_path, out_spec = pytree.tree_flatten_with_path(out)
        layout.out_spec = out_spec
        results: list[torch.Tensor] = []
        for path, leaf in out_leaves_with_path:
            _check_output_leaf(leaf, "output" + pytree.keystr(path))
            if isinstance(leaf, torch.Tensor):
                layout.out_leaves.append(("tensor", len(results)))
                results.append(_from_fun(leaf) if _is_fun(leaf) else leaf)
            else:
                layout.out_leaves.append(("const", leaf))
        layout.n_user_tensors = len(results)

        # ---- optimizer state written or created by the step
        if opt is not None:
            f_index = {id(fp): i for i, fp in enumerate(f_params)}
            inputs_by_slot = dict(zip(layout.state_inputs, f_states))
            for key_t, entries in traced_state.items():
                i = f_index.get(id(key_t))
                if i is None:
                    raise SpmdTraceError(
                        "the optimizer created state for a tensor that is not one of the "
                        "module's parameters"
                    )
                before = opt_state_before.get(i)
                if before is None or set(entries) - set(before):
                    layout.creates_state = True
                    layout.state_touched.append(i)
                for k, v in entries.items():
                    if (i, k) in inputs_by_slot and v is inputs_by_slot[(i, k)]:
                        continue  # updated in place: handled by the copy_ epilogue
                    if isinstance(v, torch.Tensor):
                        layout.state_outputs.append((i, k))
                        results.append(_from_fun(v) if _is_fun(v) else v)
                    elif before is None or k not in before or before[k] is not v:
                        layout.state_consts.append((i, k, v))

        # ---- final gradients
        for i, fp in enumerate(f_params):
            if fp.grad is not None:
                layout.grad_outputs.append(i)
                results.append(_from_fun(fp.grad))

        # ---- write-back of every mutated input
        groups = [
            (p_in, f_params, "parameter", binding.param_names),
            (b_in, f_bufs, "buffer", binding.buffer_names),
            (s_in, f_states, "optimizer state", None),
            (g_in, f_grads, "gradient", None),
            (a_in, f_args, "argument", None),
        ]
        for reals, funs, what, names in groups:
            for j, (real, f) in enumerate(zip(reals, funs)):
                torch._sync(f)
                if torch._functionalize_has_metadata_mutation(f.elem):
                    label = names[j][0] if names else f"#{j}"
                    raise SpmdTraceError(
                        f"the train step changed the shape or strides of {what} {label} in "
                        "place; only data mutations of inputs are supported"
                    )
                if torch._functionalize_has_data_mutation(f.elem):
                    real.copy_(_from_fun(f))
        return results

    try:
        with swapped_submodules(module, overrides), torch.fx.traceback.preserve_node_meta(), \
                lazy_graph_modules(), annotator.active(), torch.compiler._non_strict_tracing_context():
            symbolic = _symbolic_inputs(binding, layout, real_inputs)
            if symbolic is None:
                gm = make_fx(step, tracing_mode="fake", _allow_non_fake_inputs=False)(
                    *[t.detach() for t in real_inputs]
                )
            else:
                fake_mode, fake_inputs = symbolic
                with fake_mode:
                    gm = make_fx(step, tracing_mode="real")(*fake_inputs)
    except SpmdUsageError:
        raise
    except SpmdTraceError:
        raise
    except Exception as e:  # noqa: BLE001 - re-raised with context
        msg = str(e)
        if "Please convert all Tensors to FakeTensors" in msg:
            raise SpmdTraceError(
                "the train step used a real tensor that is neither a parameter, buffer, "
                "optimizer state nor an argument of the call (a tensor captured from an "
                f"enclosing scope?); pass it as an argument or register it as a buffer. ({msg[:300]})"
            ) from e
        raise SpmdTraceError(f"tracing the train step failed: {type(e).__name__}: {msg}") from e

    if opt is not None and not saw_backward[0]:
        raise SpmdUsageError(
            "spmd_backend.compile: the train step produced no parameter gradient: "
            "loss.backward() was never called, or the loss does not depend on any parameter "
            f"of {type(module).__name__} that requires grad"
        )
    names = finish_graph(gm, binding, layout)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    owner = {placeholders[i]: binding.param_names[i][0] for i in range(layout.n_params)}
    for j, (i, _k) in enumerate(layout.state_inputs):
        owner[placeholders[layout.n_params + layout.n_buffers + j]] = binding.param_names[i][0]
    annotate_optimizer_fqns(gm.graph, owner)
    if recompile:
        gm.recompile()
    return TracedStep(
        gm=gm, layout=layout, trace_seconds=time.perf_counter() - t0, placeholder_names=names
    )


def _symbolic_inputs(
    binding: StepBinding, layout: StepLayout, real_inputs: list[torch.Tensor]
) -> tuple[Any, list[torch.Tensor]] | None:
    """Fake inputs with symbolic dims where arguments are marked dynamic (None: none are)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import (
        DimDynamic,
        ShapeEnv,
        StatelessSymbolicContext,
    )

    from spmd_backend.tracing.binding import dynamic_dims

    n_state = layout.n_inputs - len(layout.arg_inputs)
    arg_dims = [dynamic_dims(binding.flat_args[j], binding.batch_dim_dynamic) for j in layout.arg_inputs]
    arg_dims = [{d for d in dims if binding.flat_args[j].shape[d] >= 2}
                for dims, j in zip(arg_dims, layout.arg_inputs)]
    if not any(arg_dims):
        return None
    mode = FakeTensorMode(shape_env=ShapeEnv())
    fakes = [mode.from_tensor(t.detach(), static_shapes=True) for t in real_inputs[:n_state]]
    for t, dims in zip(real_inputs[n_state:], arg_dims):
        if dims:
            context = StatelessSymbolicContext(
                dynamic_sizes=[DimDynamic.DYNAMIC if i in dims else DimDynamic.STATIC for i in range(t.dim())]
            )
            fakes.append(mode.from_tensor(t.detach(), symbolic_context=context))
        else:
            fakes.append(mode.from_tensor(t.detach(), static_shapes=True))
    return mode, fakes


