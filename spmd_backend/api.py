"""``spmd_backend.compile``: the full-step front door.

``@compile(gm_transformation=..., parallel_mode=..., module_override=...)`` decorates
``train_step(model, optim, batch, ...)``. On a call whose :class:`~spmd_backend.tracing.binding.
StepKey` has no cached graph it traces the whole step (forward, backward, optimizer step,
zero_grad) into one graph, expands it for data parallelism, applies the module overrides'
``transform`` and then ``gm_transformation`` exactly once, and caches the result. Every call runs
the cached graph on the live tensors: parameters, buffers and optimizer state are updated in
place, so ``model.state_dict()`` and ``optim.state_dict()`` are always the truth.

A call that would create optimizer state (the first step of Adam, SGD with momentum, ...) runs a
*bootstrap* graph once, untransformed, which creates the state exactly as eager does; the next
call traces the steady-state graph and transforms that one.

``last_train_step=True`` is consumed here and passed as ``last_iter=True`` to a transformation
result whose ``forward`` accepts it.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from spmd_backend import pending_work, pipeline
from spmd_backend.compiled_graph import CompiledGraph, accepts_last_iter
from spmd_backend.errors import SpmdUsageError
from spmd_backend.graph import ops
from spmd_backend.graph.utils import emit_graph_artifact
from spmd_backend.memory import release_freed_heap
from spmd_backend.parallel.consistency import (
    check_consistency,
    graph_signature,
    post_failure,
    signature_digest,
)
from spmd_backend.parallel.data_parallel import DataParallel, ExpansionReport
from spmd_backend.parallel.replicas import refuse_rank_local_writes
from spmd_backend.parallel.schedule_check import ScheduleBook, agree_on_schedule
from spmd_backend.parallel.sharded_state import prepare_sharding
from spmd_backend.runtime import (
    RollbackPlan,
    describe_collectives,
    log_plan,
    rollback_plan,
    run_step,
)
from spmd_backend.tracing.binding import StepBinding
from spmd_backend.tracing.grad_scaler import prepare_grad_scalers
from spmd_backend.tracing.hyperparams import moving_value_plan, unfusing_lifts
from spmd_backend.tracing.key import Guard, StepKey
from spmd_backend.tracing.object_state import module_state
from spmd_backend.tracing.overrides import Override
from spmd_backend.tracing.shapes import ShapeGuard
from spmd_backend.tracing.sharding import ShardSpec
from spmd_backend.tracing.trace import TracedStep, trace_train_step

log = logging.getLogger(__name__)

#: compiled steps are numbered in creation order (the same on every rank of an SPMD program)
_STEP_IDS = itertools.count()
#: default limit on distinct graphs one compiled step may hold
DEFAULT_MAX_GRAPHS = 8

__all__ = ["compile", "CompiledTrainStep", "DataParallel", "Override"]


def _device(binding: StepBinding) -> torch.device:
    """Where the step's parameters live (the schedule checks' device without a CPU channel)."""
    return binding.params[0].device if binding.params else torch.device("cpu")


class CompiledTrainStep:
    """The callable ``spmd_backend.compile`` returns; see the module docstring."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        gm_transformation: Callable[[fx.GraphModule], Callable[..., Any]] | None,
        parallel_mode: DataParallel,
        module_override: Sequence[Override],
        max_graphs: int = DEFAULT_MAX_GRAPHS,
        dynamic_batch: bool = False,
    ) -> None:
        self.fn = fn
        self.max_graphs = max_graphs
        self.dynamic_batch = dynamic_batch
        self._step_id = next(_STEP_IDS)
        self.gm_transformation = gm_transformation
        self.parallel_mode = parallel_mode
        self._config = pipeline.PipelineConfig(parallel=parallel_mode)
        self.module_override = list(module_override)
        self._cache: dict[StepKey, list[CompiledGraph]] = {}
        self._last: CompiledGraph | None = None
        #: optimizer id -> param groups traced single-tensor instead of fused (see _unfuse)
        self._unfused: dict[int, frozenset[int]] = {}
        self.trace_count = 0
        #: cross-rank checks of this step's graphs posted so far (they key the store rounds)
        self._consistency_rounds = 0
        #: this rank's place in the optimizer sharding (``shard_optimizer=True``), set on first use
        self._shard_spec: ShardSpec | None = None
        #: the module and optimizer the last call left moved work pending for
        self._held = pending_work.Held(self._flush_held, self._name)
        #: agreed digests of the cached graphs with collectives; with two or more, every call
        #: checks that all ranks run the same one (parallel/schedule_check.py)
        self._schedules = ScheduleBook(self._name)
        functools.update_wrapper(self, fn)

    # ----------------------------------------------------------------- introspection
    @property
    def graph(self) -> CompiledGraph | None:
        """The graph the most recent call ran (``None`` before the first call)."""
        return self._last

    @property
    def compiled(self) -> Callable[..., Any] | None:
        """The cached ``gm_transformation`` result of the most recent steady-state graph."""
        entries = [e for group in self._cache.values() for e in group]
        return entries[-1].runner if entries else None

    def cache_size(self) -> int:
        return sum(len(group) for group in self._cache.values())

    # ----------------------------------------------------------------- calling
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        last_train_step = bool(kwargs.pop("last_train_step", False))
        binding = self._bind(args, kwargs)
        pending_work.settle((binding.module, binding.optimizer), self._flush_held,
                            f"{self._name} was called")
        if self._shard_state(binding):  # state loaded or created eagerly: now sharded
            binding = self._bind(args, kwargs)
        key = binding.key()
        entry, why, guard = self._lookup(key, binding)
        if entry is None and self._unfuse(binding, guard):
            binding = self._bind(args, kwargs)
            key = binding.key()
            entry, _, _ = self._lookup(key, binding)
        if self._last is not None and entry is not self._last:
            self._finish_pending(
                self._last, f"switches graphs ({why or 'the call runs another cached graph'})")
        if entry is None:
            if self.cache_size() >= self.max_graphs:
                self._drop_orphaned()
            if self.cache_size() >= self.max_graphs:
                raise SpmdUsageError(
                    f"spmd_backend.compile: {self._name} would need a new graph again "
                    f"({self.cache_size()} cached, limit {self.max_graphs}); this time because "
                    f"{why}. Keep what the step depends on stable (input shapes and dtypes, "
                    "module modes and attributes, optimizer settings, values the step reads), "
                    "or raise max_graphs"
                )
            entry = self._compile(binding, key, why)
        return self._run(entry, binding, last_train_step)

    def _drop_orphaned(self) -> None:
        """Forget the graphs traced for a module or optimizer that no longer exists (the
        earlier folds of a cross-validation), so they do not count against ``max_graphs``:
        until 2026-11-28 the ninth fresh model was refused although the others were gone."""
        for key in list(self._cache):
            kept = [e for e in self._cache[key] if not e.orphaned]
            if kept:
                self._cache[key] = kept
            else:
                del self._cache[key]
        if self._last is not None and self._last.orphaned:
            self._last = None

    def _finish_pending(self, entry: CompiledGraph, why: str) -> None:
        """Run the work ``entry``'s last call moved into the next iteration (an
        ``iter_move_grads_and_optimizers`` transformation keeps a bucket's all_reduce and
        optimizer update for the next call) before another graph runs. Without this, a retrace
        (a smaller last batch, a mode switch) dropped that update and the graph left its stale
        carried values for its next use: 0.04 off eager after one retrace, silently."""
        runner = entry.runner
        pending = getattr(runner, "pending_moves", 0)
        if not pending or not callable(getattr(runner, "flush", None)):
            return
        log.info("spmd_backend: %s: %s; first running the %d moved block(s) its last call "
                 "left for the next", self._name, why, pending)
        runner.flush()
        self._held.release()

    def flush(self) -> None:
        """Run the work the last call moved into the next one (an
        ``iter_move_grads_and_optimizers`` transformation) now. Call it on every rank (it runs
        that work's collective) before reading the parameters or optimizer state outside the
        step: a checkpoint, an eager evaluation. A no-op when nothing is pending."""
        self._flush_held("flush() was called")

    def _flush_held(self, why: str) -> None:
        if self._last is not None:
            self._finish_pending(self._last, why)

    @property
    def _name(self) -> str:
        return getattr(self.fn, "__qualname__", "train_step")

    def _bind(self, args: tuple, kwargs: dict) -> StepBinding:
        return StepBinding.from_call(
            args, kwargs, batch_dim_dynamic=self.dynamic_batch, fn=self.fn, unfused=self._unfused
        )

    def _shard_state(self, binding: StepBinding) -> bool:
        """With ``shard_optimizer``: shard the optimizer's state (see sharded_state.prepare)."""
        if not self.parallel_mode.shard_optimizer or binding.optimizer is None:
            return False
        pg = self.parallel_mode.process_group()
        self._shard_spec, changed = prepare_sharding(
            binding.optimizer, pg, self._shard_spec,
            timeout_s=self.parallel_mode.consistency_timeout_s,
        )
        return changed

    def _lookup(
        self, key: StepKey, binding: StepBinding
    ) -> tuple[CompiledGraph | None, str, Guard | ShapeGuard | None]:
        """The cached graph for this call, or None with the reason none fits (and the guard
        that failed, when a graph with the same key exists)."""
        candidates = self._cache.get(key)
        if candidates:
            failed: list[Guard | ShapeGuard] = []
            for entry in reversed(candidates):
                guard = entry.failed_guard(binding)
                if guard is None:
                    return entry, "", None
                failed.append(guard)
            first = failed[0]
            why = first.describe(binding) if isinstance(first, Guard) else first.describe()
            return None, why, first
        if self._last is None:
            return None, "first call", None
        return None, self._last.key.explain(key, binding), None

    def _unfuse(self, binding: StepBinding, guard: Guard | ShapeGuard | None) -> bool:
        """Trace a param group for moving values when one it changes between calls (betas[0],
        momentum under OneCycleLR) is baked into its implementation but a graph input of the
        single-tensor form (hyperparams.unfusing_lifts); True when that changed the binding."""
        opt = binding.optimizer
        if opt is None or not isinstance(guard, Guard) or guard.kind != "group":
            return False
        g, key, *index = guard.where
        if not unfusing_lifts(opt, g, key, index[0] if index else None):
            return False
        groups = self._unfused.get(id(opt), frozenset())
        if g in groups:
            return False
        how = moving_value_plan(opt, g)  # before the group is marked
        self._unfused[id(opt)] = groups | {g}
        log.warning(
            "spmd_backend: %s; it changes between calls (a scheduler?), so param group %d of "
            "%s %s, where it would need a new graph each time",
            guard.describe(binding), g, type(opt).__name__, how,
        )
        return True

    def _compile(self, binding: StepBinding, key: StepKey, why: str) -> CompiledGraph:
        if self._last is not None and not self._last.bootstrap:
            log.warning("spmd_backend: retracing %s: %s", self._name, why)
        mode = self.parallel_mode
        pg = mode.process_group()  # fails early, on every rank, without a process group
        del pg
        if binding.aux_objects and binding.params:
            prepare_grad_scalers(binding.aux_objects, binding.params[0].device)
        t0 = time.perf_counter()
        try:
            traced, expansion, mode_effects = self._trace(binding, key, mode)
        except Exception as e:
            if mode.check_consistency:  # the others need not wait for this rank's graph
                # the round is used up, as on a rank that traced and read this failure: a
                # retry must not find it (until 2026-11-28 a valid call after a failed first
                # one failed on one rank and hung or broke the other in the broadcast)
                self._consistency_rounds += 1
                post_failure(self._round_key(self._consistency_rounds), mode.process_group(),
                             f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            raise
        gm = traced.gm
        emit_graph_artifact(f"spmd_step_{self._step_id}_trace_{self.trace_count}", gm.graph)
        schedule = ""
        if mode.check_consistency:  # before any collective, the initial broadcast included
            schedule = self._check_consistency(traced, mode, binding)
        # the graph check above covered the state inputs: no second round through the store
        pipeline.sync([*binding.params, *binding.buffers], self._config, verify=False)
        bootstrap = traced.layout.creates_state
        runner: Callable[..., Any] = gm
        if not bootstrap:
            flat_state = traced.layout.gather(binding)[: traced.layout.n_state_inputs]
            for override in self.module_override:
                result = override.transform(gm, flat_state)
                if isinstance(result, fx.Graph):
                    result = fx.GraphModule(gm, result)
                gm = result
            traced.gm = gm
            runner = gm
            if self.gm_transformation is not None:
                runner = self.gm_transformation(gm)
        else:
            log.info(
                "spmd_backend: the first step creates optimizer state; running it untransformed "
                "(the transformation applies to the steady-state graph traced next call)"
            )
        rollback = self._rollback_plan(runner, traced, binding)
        entry = CompiledGraph(
            key=key,
            traced=traced,
            runner=runner,
            bootstrap=bootstrap,
            takes_last_iter=accepts_last_iter(runner),
            expansion=expansion,
            compile_seconds=time.perf_counter() - t0,
            rollback=rollback,
            mode_effects=mode_effects,
            schedule=schedule,
            reason=why,
            owners=tuple(weakref.ref(o) for o in (binding.module, binding.optimizer)
                         if o is not None),
        )
        if not bootstrap:
            self._cache.setdefault(key, []).append(entry)
            if (schedule and any(ops.is_collective(n) for n in traced.gm.graph.nodes)
                    and self._schedules.agreed(schedule)):
                log.info("spmd_backend: %s now has cached graphs with different collectives "
                         "(this one traced because %s); from now on each call first checks "
                         "that every rank runs one with the same collectives", self._name, why)
        release_freed_heap()  # what tracing and compiling freed (hundreds of MB) back to the OS
        log.info(
            "spmd_backend: traced %s in %.2fs (%d nodes, %d all_reduce, %d reduce_scatter, "
            "%d all_gather, bootstrap=%s)", self._name, traced.trace_seconds,
            len(traced.gm.graph.nodes), expansion.all_reduces, expansion.reduce_scatters,
            expansion.all_gathers, bootstrap,
        )
        return entry

    def _trace(
        self, binding: StepBinding, key: StepKey, mode: DataParallel
    ) -> tuple[TracedStep, ExpansionReport, tuple[tuple[nn.Module, bool], ...]]:
        """Trace the step and expand its markers into collectives (no collective runs)."""
        modes = [m.training for _, m in binding.modules]
        try:
            traced = trace_train_step(
                self.fn,
                binding,
                mark_buffers=mode.broadcast_buffers and bool(binding.buffers),
                overrides=self.module_override,
                recompile=False,
                shard=self._shard_spec if binding.optimizer is not None else None,
            )
        finally:
            # ``model.train()`` inside the step: the entry replays the switch after each
            # successful run (a failed call leaves the modes as they were)
            mode_effects = tuple(
                (m, m.training) for (_, m), before in zip(binding.modules, modes)
                if m.training != before
            )
            for (_, m), before in zip(binding.modules, modes):
                m.training = before
        self.trace_count += 1
        after = dataclasses.replace(key, modules=module_state(binding.modules),
                                    free_values=binding.free_values())
        if after != key:  # the step itself changed what the key holds: it will not replay that
            log.warning(
                "spmd_backend: tracing %s changed what it reads (%s); the compiled graph "
                "does not repeat Python side effects, so the next call retraces", self._name,
                key.explain(after, binding),
            )
        gm = traced.gm
        if mode.check_consistency:  # on the markers, before they become collectives
            refuse_rank_local_writes(gm.graph, traced.layout, binding)
        expansion = pipeline.expand(gm, self._config)
        return traced, expansion, mode_effects

    def _rollback_plan(self, runner: Any, traced: TracedStep, binding: StepBinding) -> RollbackPlan:
        """What each call snapshots so that a failure can restore it (logged with its size)."""
        rollback = rollback_plan(runner, traced.gm.graph, traced.layout.n_inputs)
        if rollback.positions:
            log_plan(rollback, self._name, traced.layout.gather(binding))
        return rollback

    def _check_consistency(self, traced: TracedStep, mode: DataParallel,
                           binding: StepBinding) -> str:
        """Agree with the other ranks on the new graph's state inputs and collectives; returns
        their digest. A graph whose digest is that of the graph this rank ran last, or one every
        rank already agreed on (in the step's schedule book), needs no new round: its peers
        run, or replay, that schedule. So one rank may retrace alone (its last batch is smaller,
        its padded length changed) while the others replay their graph, as with DDP; before,
        it waited for peers that never post and failed after the timeout, and until 2026-11-28
        it hung where its last graph was another schedule (a retrace on a stepping call of
        gradient accumulation that alternates with non-stepping ones: its peers were already in
        the per-call schedule check). A new digest, once calls are checked per call, first
        joins that check: peers replaying an agreed graph then fail with this rank at once,
        and peers that traced the same new graph pass it and join the round."""
        lines = graph_signature(traced.gm.graph)  # the expanded graph: passes are deterministic
        digest = signature_digest(lines)
        if (self._last is not None and self._last.schedule == digest) or \
                digest in self._schedules.digests:
            log.info("spmd_backend: %s's new graph has the state inputs and collectives of a "
                     "graph every rank agreed on; no new agreement with the other ranks",
                     self._name)
            return digest
        if len(self._schedules.digests) > 1:
            agree_on_schedule(
                digest, mode.process_group(), what=self._name,
                hint=" This rank traced a new graph at this call.",
                device=_device(binding))
        self._consistency_rounds += 1
        return check_consistency(
            lines, self._round_key(self._consistency_rounds), mode.process_group(),
            mode.consistency_timeout_s,
        )

    def _round_key(self, round_no: int) -> str:
        """The store key of this step's ``round_no``-th cross-rank check."""
        return f"{self._name}#{self._step_id}/{round_no}"

    @staticmethod
    def _collectives(entry: CompiledGraph) -> str:
        return describe_collectives(getattr(entry.runner, "graph", entry.traced.gm.graph))

    def _run(self, entry: CompiledGraph, binding: StepBinding, last_train_step: bool) -> Any:
        layout = entry.layout
        layout.refuse_aliased_writes(binding)
        flat = layout.gather(binding, entry.hyper_cache)
        kwargs: dict[str, Any] = {}
        if last_train_step:
            if entry.takes_last_iter:
                kwargs["last_iter"] = True
            elif not entry.bootstrap:
                raise SpmdUsageError(
                    "last_train_step=True was passed, but the compiled graph keeps no work "
                    "across iterations (its forward takes no `last_iter`); pass it only with a "
                    "gm_transformation that returns an IterGraphModule"
                )
        self._schedules.check(
            entry.schedule, self.parallel_mode.process_group(),
            _device(binding), what=self._name,
            hint=f" This rank's graph is the one traced when: {entry.reason or 'first call'}.",
        )
        outs = run_step(
            entry.runner, flat, kwargs, entry.rollback, lambda: self._collectives(entry)
        )
        self._last = entry
        self._held.after_call(entry.runner, (binding.module, binding.optimizer))
        result = layout.commit(binding, list(outs))
        for module, training in entry.mode_effects:
            module.training = training
        return result


def compile(
    module_override: Sequence[Override] | None = None,
    gm_transformation: Callable[[fx.GraphModule], Callable[..., Any]] | None = None,
    parallel_mode: DataParallel | None = None,
    *,
    max_graphs: int = DEFAULT_MAX_GRAPHS,
    dynamic_batch: bool = False,
) -> Callable[[Callable[..., Any]], CompiledTrainStep]:
    """Compile a whole data-parallel train step; use as ``@compile(...)``.

    ``module_override``: :class:`Override` objects swapping submodules for tracing and
    transforming the traced graph. ``gm_transformation``: called once per traced graph with the
    expanded ``fx.GraphModule``; its result is what runs (it must take the same flat inputs and
    return the same outputs). ``parallel_mode``: :class:`DataParallel` (default: SUM reduction
    over WORLD, buffers broadcast like DDP). ``max_graphs``: how many distinct graphs (input
    shapes, state structure, hyper-parameters...) one step may compile before it is an error.
    ``dynamic_batch``: trace dim 0 of every tensor argument symbolically (a ragged last batch
    reuses the graph); ``spmd_backend.mark_dynamic(t, dims)`` marks single tensors.
    """
    if parallel_mode is None:
        parallel_mode = DataParallel()
    if not isinstance(parallel_mode, DataParallel):
        raise SpmdUsageError(
            f"compile(parallel_mode=...): expected a DataParallel, got {type(parallel_mode).__qualname__}"
        )
    overrides = list(module_override or [])
    for o in overrides:
        if not isinstance(o, Override):
            raise SpmdUsageError(
                f"compile(module_override=...): expected Override instances, got {type(o).__qualname__}"
            )

    def decorator(fn: Callable[..., Any]) -> CompiledTrainStep:
        return CompiledTrainStep(
            fn,
            gm_transformation=gm_transformation,
            parallel_mode=parallel_mode,
            module_override=overrides,
            max_graphs=max_graphs,
            dynamic_batch=dynamic_batch,
        )

    return decorator
