"""``torch.compile(step, backend="spmd")``: the Dynamo door to the one pipeline.

Registered through this package's ``torch_dynamo_backends`` entry point (never at import, which
would make torch's lookup fail with a duplicate name), so a process that never imports
spmd_backend can use it. Importing this module installs the scoped whole-step capture
(:mod:`spmd_backend.dynamo.scope`). Dynamo then hands each captured graph to
:func:`spmd_dynamo_backend`, which builds a :class:`~spmd_backend.pipeline.PipelineConfig` from
``options`` (validated by the same code as the compile door's), verifies that the ranks' module
state agrees and broadcasts it once,
marks buffers for DDP's per-step broadcast and then, by what the graph holds:

* **whole step** (the graph calls ``torch.autograd.grad``: forward, backward, optimizer step and
  ``zero_grad`` in one graph): each gradient gets a ``grad_ready`` marker, AOTAutograd makes one
  functional aten graph, and the pipeline runs on it exactly as on a ``spmd_backend.compile``
  graph (float64 bias corrections, expansion, bucketing, wait scheduling, in-place optimizer,
  Inductor); the result is stored in AOTAutograd's cache, keyed also by everything the pipeline
  reads, and served to later processes (:mod:`spmd_backend.dynamo.step_cache`);
* **per graph** (a graph break kept the step apart, another torch version, compiled autograd
  off): forward graphs get the buffer broadcast, AOT backward graphs a ``grad_ready`` marker on
  every parameter gradient (from the output descriptors) and then the same pipeline; every
  parameter is audited (:mod:`spmd_backend.dynamo.audit`) so a gradient from an eager region
  raises instead of training unsynchronized. The fallback is logged once with its reason.

Compiled autograd's backward graph is refused with an error naming it.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch._dynamo.utils import counters

from spmd_backend import pipeline
from spmd_backend.dynamo import (
    audit,
    faults,
    float_inputs,
    fresh_state,
    graphs,
    per_graph,
    scope,
    step_cache,
)
from spmd_backend.errors import SpmdUsageError
from spmd_backend.graph import ops
from spmd_backend.graph.fused_operands import MISMATCH_ADVICE, fused_operand_mismatch
from spmd_backend.graph.meta import Phase
from spmd_backend.memory import release_freed_heap
from spmd_backend.parallel import consistency
from spmd_backend.parallel.replicas import drift_error, rank_local_writes
from spmd_backend.parallel.schedule_check import ScheduleBook
from spmd_backend.pipeline import PipelineConfig
from spmd_backend.runtime import GuardedStep
from spmd_backend.tracing.adam_denominator import fold_step_size_after_eps
from spmd_backend.tracing.bias_corrections import upcast_bias_corrections
from spmd_backend.tracing.object_state import global_module_hooks

log = logging.getLogger(__name__)

scope.install()


def _runner(module: Any) -> Any:
    """A boxed callable (what AOTAutograd's compilers return) running ``module``."""
    from functorch.compile import make_boxed_func

    return make_boxed_func(module)


def _refuse_unlike_fused_operands(graph: fx.Graph) -> None:
    """Refuse a graph whose fused optimizer kernel would fail after writing its step counts
    (graph/fused_operands.py), before anything runs."""
    found = fused_operand_mismatch(graph)
    if found is not None:
        raise SpmdUsageError(f'backend="spmd": {found.describe()}. {MISMATCH_ADVICE}')


def _compile_aot(
    gm: fx.GraphModule, example_inputs: list[Any], config: PipelineConfig,
    inputs: graphs.DynamoInputs, *, whole_step: bool, facts: per_graph.BackwardFacts,
) -> Any:
    from torch._dynamo.backends.common import aot_autograd

    params = dict(inputs.fqns)
    # by position and weakly: a cached graph must not keep a model alive (a k-fold loop's
    # earlier folds; until 2026-11-28 every model a step had compiled for stayed in memory)
    watched_positions = list(inputs.params)
    watched_attributes = [weakref.ref(p) for p in inputs.attributes]

    def whole_module(g: fx.GraphModule, ex: list[Any]) -> Any:
        _refuse_unlike_fused_operands(g.graph)
        step_cache.drop_key(g.graph)
        graphs.hoist_markers(g.graph)
        positions = graphs.dynamo_input_positions(g.graph)
        if config.parallel.check_consistency:  # on the markers, before they become collectives
            local, replicated = (_by_aot_position(positions, roles)
                                 for roles in _replica_roles(gm, inputs))
            writes = rank_local_writes(g.graph, local, replicated, {})
            if writes:
                raise drift_error(writes, 'backend="spmd"', g.graph)
        if config.parallel.shard_optimizer:  # the reduce_scatter needs the marker unhidden
            graphs.fold_gradient_copies(g.graph)
        graphs.annotate_phases(g.graph, _by_aot_position(positions, inputs.kinds),
                               split_optimizer=True)
        upcast_bias_corrections(g.graph)
        fold_step_size_after_eps(g.graph)
        report = pipeline.expand(g, config)
        counters["spmd"]["reduce_scatters"] += report.reduce_scatters
        counters["spmd"]["all_gathers"] += report.all_gathers
        return pipeline.transform(g, config, tag="whole_step").module

    def whole(g: fx.GraphModule, ex: list[Any]) -> Any:
        return GuardedStep(whole_module(g, ex), step_cache.WHOLE_STEP)

    def forward(g: fx.GraphModule, ex: list[Any]) -> Any:
        _refuse_unlike_fused_operands(g.graph)  # per-graph mode's optimizer step is one
        step_cache.drop_key(g.graph)
        graphs.annotate_phases(
            g.graph, _by_aot_position(graphs.dynamo_input_positions(g.graph), inputs.kinds),
            default=Phase.FORWARD)
        upcast_bias_corrections(g.graph)
        fold_step_size_after_eps(g.graph)
        pipeline.expand(g, config)
        return _runner(pipeline.transform(g, config, with_optimizer=False, tag="forward").module)

    def backward(g: fx.GraphModule, ex: list[Any]) -> Any:
        if not graphs.has_descriptors(g.graph):
            raise SpmdUsageError(
                'backend="spmd": the backward graph carries no output descriptors; this torch '
                "build is not supported (torch 2.13 is required)"
            )
        facts.reduced = graphs.mark_backward_outputs(g.graph, params)
        graphs.annotate_phases(g.graph, default=Phase.BACKWARD)
        pipeline.expand(g, config)
        return _runner(pipeline.transform(g, config, with_optimizer=False, tag="backward").module)

    cached = whole_step and _cache_key(gm, config, inputs)
    if cached:
        kwargs = step_cache.compilers(whole_module, forward, backward, config.lowering())
    else:
        inference = whole if whole_step else forward
        kwargs = {"fw_compiler": forward, "bw_compiler": backward, "inference_compiler": inference}
    aot = aot_autograd(**kwargs, keep_inference_input_mutations=True)
    bundled = step_cache.bundled if cached else contextlib.nullcontext
    hits = step_cache.hits()
    try:
        with bundled():
            compiled = aot(gm, example_inputs)
    except RuntimeError as e:
        if "rematerialization" not in str(e):
            raise
        # torch 2.13 refuses to recompute checkpointed regions holding an op tagged
        # nondeterministic_seeded (SDPA is, even without dropout): keep their activations
        log.warning(
            'backend="spmd": activation-checkpointed regions of this step are not recomputed '
            "(%s); the step runs correctly with their activations kept", str(e).splitlines()[0]
        )
        with torch._functorch.config.patch(remat_using_tags_for_fwd_loss_bwd_graph=False), \
                bundled():
            compiled = aot(gm, example_inputs)
    if step_cache.hits() > hits:
        log.info('backend="spmd": the whole-step graph came from the AOTAutograd cache')
    if not whole_step and "grad" in inputs.kinds.values():
        def checked(*args: Any) -> Any:  # an optimizer-step graph of per-graph mode
            attributes = [p for ref in watched_attributes if (p := ref()) is not None]
            audit.check_before_step([*(args[i] for i in watched_positions), *attributes])
            return compiled(*args)

        return checked
    return compiled


def _cache_key(gm: fx.GraphModule, config: PipelineConfig, inputs: graphs.DynamoInputs) -> bool:
    """Key the whole-step compile for AOTAutograd's cache (:mod:`spmd_backend.dynamo.step_cache`);
    False, logged once with the reason, when it is not cached."""
    key, reason = step_cache.digest(gm, config, inputs)
    if key is not None:
        step_cache.insert_key(gm, key)
        reason = step_cache.blocker(gm) or ""
    if reason and not counters["spmd"]["cache_bypass_logged"]:
        counters["spmd"]["cache_bypass_logged"] += 1
        log.info('backend="spmd": the compiled step is not cached (%s)', reason)
    return not reason


def _by_aot_position(positions: dict[int, int], by_input: dict[int, Any]) -> dict[int, Any]:
    """``by_input`` (Dynamo graph input -> value) keyed by the AOT graph's placeholder positions
    (``positions``, :func:`graphs.dynamo_input_positions`: AOTAutograd merges aliased inputs
    into one base and adds seeds and tokens, so positions shift)."""
    return {k: by_input[i] for k, i in positions.items() if i in by_input}


def _replica_roles(gm: fx.GraphModule, inputs: graphs.DynamoInputs) -> tuple[dict, dict]:
    """Placeholder position -> label: the rank-local inputs (tensor inputs of more than one
    element that are not module or optimizer state: the batch) and the replicated state
    (parameters, optimizer state, existing gradients); see parallel.replicas."""
    local: dict[int, str] = {}
    replicated: dict[int, str] = {}
    for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        kind = inputs.kinds.get(i)
        source = getattr(node.meta.get("grapharg"), "source", None)
        name = getattr(source, "name", None) or node.name
        name = name() if callable(name) else name
        if kind == "param":
            replicated[i] = f"parameter {inputs.fqns[i]!r}"
        elif kind in ("state", "grad"):
            replicated[i] = f"{'optimizer state' if kind == 'state' else 'the gradient'} {name}"
        elif kind == "arg":
            example = getattr(node.meta.get("grapharg"), "example", None)
            if isinstance(example, torch.Tensor) and example.numel() > 1:
                local[i] = f"input {name}"
    return local, replicated


def _fallback_reason() -> str:
    breaks = counters["graph_break"]
    if breaks:
        reason = list(breaks)[-1]
        return f"a graph break: {str(reason).splitlines()[0][:200]}"
    if not scope.SUPPORTED:
        return f"torch {torch.__version__} is not 2.13 (whole-step capture is version-gated)"
    return "the step's graph does not contain its backward"


def _warn_on_recompiles(gm: fx.GraphModule) -> None:
    compile_id = gm.meta.get("dynamo_compile_id")
    if getattr(compile_id, "frame_compile_id", 0) < 2 or counters["spmd"]["recompile_warned"]:
        return
    counters["spmd"]["recompile_warned"] += 1
    log.warning(
        'backend="spmd": Dynamo compiled this step %d times. It recompiles for a new model, '
        "optimizer or parameter, and bakes Python numbers that change "
        "between calls into each graph where it cannot keep them inputs (a fused optimizer's "
        "momentum or betas a scheduler moves, a scheduler's lr on bfloat16/float16 parameters, "
        "a number passed where an op needs a constant; TORCH_LOGS=recompiles names it); "
        "spmd_backend.compile makes an optimizer's "
        "hyper-parameters graph inputs. At torch._dynamo.config.recompile_limit Dynamo would run "
        "the step eagerly, unsynchronized: the call is refused before it runs",
        compile_id.frame_compile_id + 1,
    )


def _refuse_compiled_autograd(gm: fx.GraphModule) -> None:
    if any(ops.is_compiled_autograd_accumulate(n) for n in gm.graph.nodes):
        raise SpmdUsageError(
            'backend="spmd": this is compiled autograd\'s backward graph '
            "(torch._dynamo.compiled_autograd is enabled); backend=\"spmd\" captures the "
            "backward inside the step's own graph instead and cannot reduce gradients here. "
            "Disable compiled autograd for steps compiled with backend=\"spmd\""
        )


def spmd_dynamo_backend(
    gm: fx.GraphModule, example_inputs: list[Any], options: dict[str, Any] | None = None
) -> Any:
    """The Dynamo backend registered as "spmd" (see the module docstring)."""
    config = PipelineConfig.from_options(options, door="dynamo")
    config.parallel.process_group()  # raises on every rank without a process group
    scope.raise_refusal()  # an optimizer that shard_optimizer cannot serve
    _refuse_compiled_autograd(gm)
    float_inputs.tensorify_float_inputs(gm)  # a scheduler's float stays an input: no recompile per value
    try:
        return _compile(gm, example_inputs, config)
    finally:
        float_inputs.forget_baked()  # this frame's bake requests are served


def _compile(gm: fx.GraphModule, example_inputs: list[Any], config: PipelineConfig) -> Any:
    """The rest of :func:`spmd_dynamo_backend`, once the float inputs are settled."""
    inputs = graphs.classify_inputs(gm)
    graphs.guard_parameter_identity(gm, faults.OPTIMIZER_PARAMS)  # a replaced one recompiles
    pipeline.sync(inputs.state_tensors(), config, inputs.state_names())  # verified, then broadcast
    hooked = {i: p for i, p in inputs.params.items() if p.requires_grad}
    audit.refuse_gradient_hooks(hooked, inputs.fqns)
    for i, p in inputs.params.items():  # a backward that runs eagerly must not go unnoticed
        audit.watch(p, inputs.fqns[i])
    _warn_on_recompiles(gm)
    if config.parallel.broadcast_buffers:
        graphs.mark_buffers(gm, inputs)
    graphs.functionalize_fused_optimizers(gm)
    whole_step = bool(graphs.autograd_grad_calls(gm.graph))
    if whole_step:
        graphs.refuse_data_and_gradient_mutation(gm, inputs)
        marked = graphs.mark_gradients(gm, inputs)
        counters["spmd"]["whole_step_graphs"] += 1
        log.info('backend="spmd": whole-step graph with %d gradient(s)', len(marked))
    elif any(p.requires_grad for p in inputs.params.values()):
        counters["spmd"]["per_graph_graphs"] += 1
        if counters["spmd"]["fallback_logged"] == 0:
            counters["spmd"]["fallback_logged"] += 1
            log.warning(
                'backend="spmd": whole-step capture is not possible (%s); running in per-graph '
                "mode: every backward graph reduces its gradients, and a gradient from an eager "
                "region raises. A model free of graph breaks (torch._dynamo.explain lists them; "
                "a logging call is one) lets one graph hold the whole step", _fallback_reason(),
            )
    # before compiling: ranks that took different paths learn it before the expensive part
    check = _schedule_check(gm, config, hooked, inputs.fqns) if whole_step else None
    facts = per_graph.BackwardFacts()
    compiled = _compile_aot(gm, example_inputs, config, inputs, whole_step=whole_step, facts=facts)
    if whole_step and marked:
        compiled = _marking_reduced(compiled, list(dict.fromkeys(marked)))
    elif not whole_step and hooked:
        compiled = _per_graph_calls(compiled, gm, config, hooked, inputs.fqns, facts)
    compiled = _checked_before_each_call(compiled, list(hooked), inputs.fqns, check)
    release_freed_heap()  # what tracing and compiling freed, back to the OS
    return compiled


def _marking_reduced(compiled: Any, positions: list[int]) -> Any:
    """``compiled`` (a whole-step graph) telling the audit, after each call, that it reduced the
    gradients of the parameters at input ``positions``: where a graph break splits the step
    after ``loss.backward()`` (``if loss.item() < x: optimizer.step()``), the optimizer-step
    graph then steps on them."""
    def run(*args: Any) -> Any:
        out = compiled(*args)
        audit.mark_reduced_in_graph([args[i] for i in positions])
        return out

    return run

#: (process group name, Dynamo frame id) -> the agreed digests of that frame's whole-step graphs
_BOOKS: dict[tuple[str, Any], ScheduleBook] = {}


def _reduced_lines(params: dict[int, torch.Tensor], fqns: dict[int, str]) -> list[str]:
    """What a graph's collectives depend on, per reduced parameter in input order: the lines the
    schedule checks of both modes digest."""
    return [f"{fqns[i]}: {list(p.shape)} {p.dtype}" for i, p in params.items()]


def _compile_name(gm: fx.GraphModule) -> str:
    compile_id = gm.meta.get("dynamo_compile_id")
    return (f"frame {getattr(compile_id, 'frame_id', '?')}'s compile "
            f"{getattr(compile_id, 'frame_compile_id', '?')}")


def _schedule_check(
    gm: fx.GraphModule, config: PipelineConfig, params: dict[int, torch.Tensor],
    fqns: dict[int, str],
) -> Callable[[], None] | None:
    """Agree on a new whole-step graph's reduced parameters with every rank, and return the
    per-call check (parallel/schedule_check.py): Dynamo picks among a frame's graphs by guards
    on Python values, which may differ between ranks (a non-tensor argument); two cached graphs
    that reduce other parameters in same-sized buckets would sum one layer's gradient into
    another's."""
    mode = config.parallel
    if not mode.check_consistency or not params:
        return None
    pg = mode.process_group()
    compile_id = gm.meta.get("dynamo_compile_id")
    frame = getattr(compile_id, "frame_id", None)
    book = _BOOKS.setdefault((pg.group_name, frame), ScheduleBook(f"frame {frame}"))
    digest = book.admit(_reduced_lines(params, fqns), pg, mode.consistency_timeout_s)
    device = next(iter(params.values())).device
    hint = f" This rank's graph is {_compile_name(gm)}."
    return lambda: book.check(digest, pg, device, 'backend="spmd"', hint)


def _per_graph_calls(
    compiled: Any, gm: fx.GraphModule, config: PipelineConfig, params: dict[int, torch.Tensor],
    fqns: dict[int, str], facts: per_graph.BackwardFacts,
) -> Any:
    """A per-graph forward auditing the parameters each call receives and, on groups of several
    ranks, tagging its backward node for the check that every rank runs the same backward graphs
    (once per ``backward()``, :mod:`spmd_backend.dynamo.per_graph`)."""
    mode = config.parallel
    pg = mode.process_group()
    check = mode.check_consistency and dist.get_world_size(pg) > 1
    names = ", ".join(sorted(fqns[i] for i in params))[:200]
    return per_graph.watching_each_call(
        compiled, list(params), fqns, facts,
        consistency.signature_digest(_reduced_lines(params, fqns)),
        per_graph.backward_schedule(pg) if check else None, f"{_compile_name(gm)} ({names})",
    )


def _checked_before_each_call(
    compiled: Any, positions: list[int], fqns: dict[int, str],
    check: Callable[[], None] | None = None,
) -> Any:
    """``compiled``, raising before it runs when a parameter (at input ``positions``) got a
    gradient hook since it was compiled, warning once when global module hooks changed (Dynamo
    guards neither), and running ``check`` (the schedule check) first."""
    at_compile = global_module_hooks()
    warned = [False]

    def run(*args: Any) -> Any:
        if check is not None:
            check()
        fresh_state.refresh()  # fresh optimizer state of parameters not updated yet
        if positions:
            audit.refuse_gradient_hooks({i: args[i] for i in positions}, fqns)
        if not warned[0]:
            changed = audit.changed_global_hooks(at_compile)
            if changed:
                warned[0] = True
                log.warning(
                    'backend="spmd": global module hooks (%s) were registered or removed after '
                    "this step was compiled; Dynamo does not guard them, so the compiled graph "
                    "keeps running the hooks it was compiled with. A profiler's or tracker's "
                    "hooks change nothing; if a hook changes what the model computes, call "
                    "torch._dynamo.reset() after registering or removing it",
                    ", ".join(changed),
                )
        return compiled(*args)

    return run


scope.mark_whole_step(spmd_dynamo_backend)

__all__ = ["spmd_dynamo_backend"]
