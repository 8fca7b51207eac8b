"""Trace a whole train step (forward, backward, optimizer step, zero_grad) into one fx graph.

Requires: a :class:`~spmd_backend.tracing.binding.StepBinding` of the call (one module, at most
one optimizer). Guarantees: the returned :class:`TracedStep` holds a functional aten-level
``fx.GraphModule`` with flat tensor inputs and a flat output list, traced under fake tensors (no
real compute), laid out as :mod:`spmd_backend.tracing.layout` describes, with every node
annotated with its phase (:mod:`spmd_backend.graph.meta`) and every gradient passing through a
marker where it becomes final (:mod:`spmd_backend.tracing.step_function`). Writes to inputs
are ``aten.copy_`` nodes into the placeholders at the end of the graph.

The whole trace presents itself as compiling (``torch.compiler.is_compiling()`` is true), as
``torch.compile`` would: library code (transformers' attention masks, torch.optim's step
counts) takes its graph-friendly branches instead of data-dependent ones. The optimizer is
traced in its capturable, tensor-hyper-parameter form, so a scheduler is honoured without
retracing. The :class:`TracedStep` also carries the graph's guards: the values the trace read
(:mod:`spmd_backend.tracing.key`) and, for dims traced symbolically, the shape guards the model
imposed. The user's module, optimizer and GradScalers are restored in ``finally`` blocks.

::

    trace_train_step = plan_inputs -> StepFunction under make_fx -> finish_graph -> guards
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch._dispatch.python import enable_python_dispatcher
from torch.fx.experimental.proxy_tensor import make_fx

from spmd_backend.errors import SpmdTraceError, SpmdUsageError
from spmd_backend.graph.fused_operands import MISMATCH_ADVICE, fused_operand_mismatch
from spmd_backend.graph.ops import written_nodes
from spmd_backend.graph.utils import lazy_graph_modules
from spmd_backend.tracing.adam_denominator import fold_step_size_after_eps
from spmd_backend.tracing.annotate import ModuleAnnotator, annotate_optimizer_fqns
from spmd_backend.tracing.bias_corrections import upcast_bias_corrections
from spmd_backend.tracing.binding import StepBinding
from spmd_backend.tracing.causal_mask import traced_without_mask_decision
from spmd_backend.tracing.data_assignment import data_assignment_as_copy
from spmd_backend.tracing.decompositions import aten_kernels_kept
from spmd_backend.tracing.dispatch import TraceContext
from spmd_backend.tracing.errors import trace_error
from spmd_backend.tracing.finish import finish_graph
from spmd_backend.tracing.free_values import random_generators
from spmd_backend.tracing.hyperparams import slot_label
from spmd_backend.tracing.key import Guard
from spmd_backend.tracing.layout import StepLayout, plan_inputs
from spmd_backend.tracing.overrides import Override, swapped_submodules
from spmd_backend.tracing.random_state import RandomReplay, traced_randomness
from spmd_backend.tracing.schedulers import refuse_scheduler_steps
from spmd_backend.tracing.shapes import ShapeGuard, symbolic_inputs
from spmd_backend.tracing.sharding import ShardSpec
from spmd_backend.tracing.step_function import StepFunction
from spmd_backend.tracing.tracked import ReadRecorder
from spmd_backend.tracing.unbound_optimizers import refuse_unbound_optimizers
from spmd_backend.tracing.user_collectives import refuse_user_collectives
from spmd_backend.tracing.values import hashable

log = logging.getLogger(__name__)


@dataclass
class TracedStep:
    """A traced train step: the graph, its layout, its guards and how long tracing took."""

    gm: fx.GraphModule
    layout: StepLayout
    trace_seconds: float
    placeholder_names: list[str]
    guards: list[Guard] = field(default_factory=list)
    shape_guard: ShapeGuard | None = None


@contextlib.contextmanager
def compiling() -> Iterator[None]:
    """``torch.compiler.is_compiling()`` is true inside, as under ``torch.compile``.

    With the flag set, ``nn.Module`` skips its always-called forward hooks when a forward
    raises; non-reentrant checkpoint's early stop raises inside a module's forward during
    recompute, which would leave module trackers (ours, ModTracker) unbalanced. Early stop only
    saves recompute work, which dead-code elimination removes from the graph anyway, so it is
    turned off for the trace.

    oneDNN (mkldnn) is off while tracing: with it, ``nn.LSTM``/``GRU`` trace into
    ``mkldnn_rnn_layer`` whose fake kernel returns a workspace tensor the real one leaves
    undefined, so the backward failed at run time ("Expected a proper Tensor but got None for
    argument 'workspace'"). Without it they trace into plain aten ops. Only the ops a composite
    chooses at trace time change: a convolution is recorded as ``aten.convolution`` either way
    and still runs on oneDNN at run time.
    """
    saved = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        with torch.utils.checkpoint.set_checkpoint_early_stop(False), \
                torch.backends.mkldnn.flags(enabled=False):
            yield
    finally:
        torch.compiler._is_compiling_flag = saved


def trace_train_step(
    fn: Callable[..., Any],
    binding: StepBinding,
    *,
    mark_buffers: bool = False,
    overrides: Sequence[Override] = (),
    recompile: bool = True,
    shard: ShardSpec | None = None,
) -> TracedStep:
    """Trace one call of ``fn`` (bound by ``binding``) into a :class:`TracedStep`.

    ``recompile=False`` leaves ``gm.code`` stale (the graph itself is final) for a caller that
    edits the graph further and recompiles once; regenerating code is a large share of the
    trace time of big graphs. ``shard``: run ``optimizer.step()`` on this rank's shards (see
    :mod:`spmd_backend.tracing.sharding`).
    """
    t0 = time.perf_counter()
    layout, real_inputs = plan_inputs(binding)
    annotator = ModuleAnnotator(binding.module)
    ctx = TraceContext(fqn_provider=annotator.fqn, phase_provider=annotator.phase,
                       rng=RandomReplay())
    recorder = ReadRecorder()
    step = StepFunction(fn, binding, layout, ctx, mark_buffers=mark_buffers, recorder=recorder,
                        shard=shard)
    symbolic = symbolic_inputs(binding, layout, real_inputs)
    try:
        with swapped_submodules(binding.module, overrides), \
                torch.fx.traceback.preserve_node_meta(), lazy_graph_modules(), \
                annotator.active(), torch.compiler._non_strict_tracing_context(), compiling(), \
                refuse_scheduler_steps(), refuse_user_collectives(), traced_randomness(ctx.rng, random_generators(fn, binding.modules)), \
                refuse_unbound_optimizers(binding.optimizer, binding.params), \
                data_assignment_as_copy(), traced_without_mask_decision(), aten_kernels_kept():
            if symbolic is None:
                gm = make_fx(step, tracing_mode="fake", _allow_non_fake_inputs=False)(
                    *[t.detach() for t in real_inputs]
                )
            else:
                # make_fx's own symbolic mode runs under the Python dispatcher, whose meta
                # kernels take symbolic sizes (an attention mask's baddbmm failed without it)
                with symbolic.fake_mode, enable_python_dispatcher():
                    gm = make_fx(step, tracing_mode="real")(*symbolic.fake_inputs)
    except (SpmdUsageError, SpmdTraceError):
        raise
    except Exception as e:  # noqa: BLE001 - re-raised with context
        raise trace_error(e, fn) from e

    if binding.optimizer is not None and not step.saw_backward:
        if _writes_parameters(gm.graph, layout.n_params):
            raise SpmdUsageError(
                "spmd_backend.compile: the train step updates parameters without "
                "loss.backward(): gradients it computes itself (torch.autograd.grad) and assigns "
                "to .grad pass no collective, so each rank would step on its own gradients and "
                "the replicas would drift apart (DDP would too: it averages only what backward() "
                "accumulates). Let loss.backward() produce the gradients (combine the losses "
                'first), or compile with torch.compile(step, backend="spmd") and '
                "dist.all_reduce the gradients you compute. Nothing was changed."
            )
        raise SpmdUsageError(
            "spmd_backend.compile: the train step produced no parameter gradient: "
            "loss.backward() was never called, or the loss does not depend on any parameter "
            f"of {type(binding.module).__name__} that requires grad"
        )
    names = finish_graph(gm, binding, layout)
    unlike = fused_operand_mismatch(gm.graph)
    if unlike is not None:
        raise SpmdUsageError(f"spmd_backend.compile: {unlike.describe()}. {MISMATCH_ADVICE}")
    upcast_bias_corrections(gm.graph)
    fold_step_size_after_eps(gm.graph)  # capturable Adam: no NaN at lr = 0
    _annotate_optimizer(gm, binding, layout)
    if recompile:
        gm.recompile()
    shape_guard = symbolic.guard(binding) if symbolic is not None else None
    return TracedStep(
        gm=gm, layout=layout, trace_seconds=time.perf_counter() - t0, placeholder_names=names,
        guards=_guards(binding, recorder), shape_guard=shape_guard,
    )


def _writes_parameters(graph: fx.Graph, n_params: int) -> bool:
    """Whether ``graph`` writes one of its first ``n_params`` placeholders (the parameters)."""
    params = set([n for n in graph.nodes if n.op == "placeholder"][:n_params])
    return any(w in params for node in graph.nodes for w in written_nodes(node))


def _annotate_optimizer(gm: fx.GraphModule, binding: StepBinding, layout: StepLayout) -> None:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    owner = {placeholders[i]: binding.param_names[i][0] for i in range(layout.n_params)}
    for j, (i, _k) in enumerate(layout.state_inputs):
        owner[placeholders[layout.n_params + layout.n_buffers + j]] = binding.param_names[i][0]
    annotate_optimizer_fqns(gm.graph, owner)


def _guards(binding: StepBinding, recorder: ReadRecorder) -> list[Guard]:
    """Guards on what the trace read: non-lifted param-group values, the sign of lifted ones
    the step compared with zero, and argument-dict entries."""
    guards: list[Guard] = []
    opt = binding.optimizer
    lifted = set(binding.hyper_slots)
    if opt is not None:
        for g, keys in sorted(recorder.group_keys.items()):
            group = opt.param_groups[g]
            for k in sorted(keys, key=str):
                if k == "params" or k not in group:
                    continue
                value = group[k]
                if isinstance(value, tuple) and any((g, k, i) in lifted for i in range(len(value))):
                    guards.extend(
                        Guard("group", (g, k, i), slot_label((g, k, i)), hashable(v))
                        for i, v in enumerate(value) if (g, k, i) not in lifted
                    )
                elif (g, k, None) not in lifted:
                    guards.append(Guard("group", (g, k), slot_label((g, k, None)), hashable(value)))
        for slot in sorted(recorder.zero_tests, key=str):
            guard = Guard("sign", slot, slot_label(slot), None)
            guards.append(Guard("sign", slot, slot_label(slot), guard.current(binding)))
    paths = binding.arg_paths()
    for j in sorted(recorder.leaves & binding.tracked_leaves):
        guards.append(Guard("arg", (j,), f"argument {paths[j]}", binding.leaf_key(j)))
    return guards
