"""Lower a step graph to Inductor (C++/OpenMP kernels on CPU, Triton on GPU).

Requires: a graph with ``meta["val"]`` (fake tensors) on every placeholder. Guarantees:
:func:`lower_to_inductor` returns a module called exactly like the graph (same flat inputs,
same nested outputs). The whole graph, collectives included, goes to ``compile_fx`` (which
re-runs AOTAutograd's functionalization, so in-place optimizer updates and write-backs are fine;
fused optimizer kernels are first decomposed into per-parameter math Inductor can fuse, see
:mod:`spmd_backend.lowering.fused_decomp`, and other optimizers' 0-dim bias corrections are
computed once per step rather than inside every parameter's loop (an Inductor post-grad pass in
:data:`STEP_GRAPH_CONFIG`, see :mod:`spmd_backend.lowering.scalar_chains`);
functional collectives become Inductor's in-place ``all_reduce_`` + ``wait_tensor`` kept in graph
order, so a collective issued early and waited late still overlaps the compute between them.
The graph's order is the plan of the scheduling passes, so every compile of a step graph runs
under :func:`step_graph_config`, which rounds low-precision intermediates as eager does
(:func:`emulate_precision_casts`) and turns off Inductor's peak-memory reordering: it does not
know that a wait blocks, and on the seed MLP it moved the first bucket's wait and optimizer
update in front of the rest of the backward (123.5 -> 109.9 ms per step without it, fused Adam,
2 gloo ranks; docs/benchmarks.md). For a graph whose all_gathers are kept one at a time (gloo,
:mod:`spmd_backend.parallel.gloo_all_gather`) it also turns off ``reorder_for_locality``, which
moved a wait past the next all_gather.
If Inductor cannot compile the graph the graph itself is returned, with a warning that says why
(partial lowering: correctness first). Graph passes the user set in ``torch._inductor.config``
still run: a ``post_grad_custom_pre_pass`` before ours (:func:`step_graph_config`), the others
as Inductor runs them; a background compile, whose worker cannot receive them, compiles in this
process instead (:func:`user_passes`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from spmd_backend.errors import SpmdError, SpmdGraphError
from spmd_backend.lowering.bucket_inputs import protect_bucket_inputs
from spmd_backend.lowering.cat_layout import keep_cat_layouts
from spmd_backend.lowering.fused_decomp import decompose_fused_optimizers
from spmd_backend.lowering.scalar_chains import SCALAR_CHAIN_PASS
from spmd_backend.parallel.gloo_all_gather import keeps_all_gathers_apart
from spmd_backend.tracing.decompositions import aten_kernels_kept

log = logging.getLogger(__name__)


class InductorModule(nn.Module):
    """An Inductor-compiled graph, called like the fx graph it was compiled from."""

    def __init__(self, compiled: Any, out_spec: Any, source: fx.GraphModule, seconds: float) -> None:
        super().__init__()
        self.compiled = compiled
        self.out_spec = out_spec
        self.compile_seconds = seconds
        # the step graph this module replaces (what Inductor compiled is a copy of it with
        # flattened outputs and decomposed fused-optimizer kernels), for inspection
        self.graph = source.graph

    def forward(self, *args: Any) -> Any:
        flat = self.compiled(*args)
        return pytree.tree_unflatten(list(flat), self.out_spec)


def _flat_output_copy(gm: fx.GraphModule) -> tuple[fx.GraphModule, Any]:
    # a copy of the graph sharing gm's attributes (deep-copying the module would copy its
    # tensor constants, and a fake one, which a Dynamo graph may hold, cannot be copied) and
    # each node's meta values (node_copy copies the meta dict, not the fake tensors in it: a
    # deep copy of a whole-step graph's fake values costs about half a second)
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    flat, spec = pytree.tree_flatten(out)
    graph.output(tuple(flat))
    return fx.GraphModule(gm, graph), spec


def example_inputs(gm: fx.GraphModule) -> list[Any]:
    """Fake example inputs from the placeholders' ``meta["val"]``."""
    vals = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if "val" not in node.meta:
                raise SpmdGraphError(f"lower_to_inductor: placeholder {node.name} has no meta['val']")
            vals.append(node.meta["val"])
    return vals


def flat_for_inductor(gm: fx.GraphModule) -> tuple[fx.GraphModule, Any]:
    """The copy of ``gm`` Inductor compiles (flat outputs, fused optimizer kernels decomposed,
    one-tensor concatenations copied in eager's layout, bucket inputs read elsewhere copied
    before their bucket) and the spec that nests its outputs back."""
    flat_gm, spec = _flat_output_copy(gm)
    decompose_fused_optimizers(flat_gm)
    keep_cat_layouts(flat_gm)
    protect_bucket_inputs(flat_gm)
    return flat_gm, spec


#: Inductor settings every compile of a step graph uses, in this process and in the compile
#: worker alike (the FX-graph cache key includes them, so both must agree): the graph's order
#: kept, and optimizer scalar math computed once per step (lowering/scalar_chains.py)
STEP_GRAPH_CONFIG: dict[str, Any] = {
    "reorder_for_peak_memory": False,
    "post_grad_custom_pre_pass": SCALAR_CHAIN_PASS,
}


#: Inductor options that hold graph passes; they are not part of ``save_config()``, so a
#: compile worker never receives them (see :func:`user_passes`)
PASS_OPTIONS: tuple[str, ...] = (
    "pre_grad_custom_pass", "joint_custom_pre_pass", "joint_custom_post_pass",
    "post_grad_custom_pre_pass", "post_grad_custom_post_pass",
)


def _theirs(value: Any) -> tuple[Any, ...]:
    from torch._inductor.custom_graph_pass import get_custom_graph_passes

    return tuple(p for p in get_custom_graph_passes(value) if p is not SCALAR_CHAIN_PASS)


def user_passes() -> list[str]:
    """The :data:`PASS_OPTIONS` that hold a pass set by the user (ours excluded)."""
    import torch._inductor.config

    return [name for name in PASS_OPTIONS if _theirs(getattr(torch._inductor.config, name))]


#: torch's environment switch for ``emulate_precision_casts``; when the user set it, theirs wins
EMULATE_CASTS_ENV = "TORCHINDUCTOR_EMULATE_PRECISION_CASTS"


def emulate_precision_casts() -> bool:
    """Whether step graphs round low-precision intermediates as eager does: True unless the
    user set :data:`EMULATE_CASTS_ENV` (then torch's setting, read from it).

    Fused into one kernel, two bf16/fp16 ops keep their intermediate in fp32 where eager
    rounds it to bf16 (Inductor's default): the compiled step then trains differently from
    DDP's eager step. torch.optim.Muon's bf16 Newton-Schulz iteration was 7e-3 off DDP after
    6 steps (2 ranks, MLP, lr 0.02); with the casts emulated, 3e-8 (docs/ddp_users.md,
    "Optimizers")."""
    import torch._inductor.config

    if os.environ.get(EMULATE_CASTS_ENV) is not None:
        return bool(torch._inductor.config.emulate_precision_casts)
    return True


def step_graph_config(graph: fx.Graph | None = None) -> contextlib.AbstractContextManager[None]:
    """Inductor's configuration patched with :data:`STEP_GRAPH_CONFIG`. A
    ``post_grad_custom_pre_pass`` the user set keeps running, before ours (Inductor takes a
    tuple of passes; a pass that is not a ``CustomGraphPass`` with a ``uuid`` makes Inductor
    bypass its FX-graph cache, as it would without us). For a ``graph`` whose all_gathers are
    kept one at a time (gloo: :mod:`spmd_backend.parallel.gloo_all_gather`), also
    ``reorder_for_locality=False``, which would move a wait past the next all_gather (decided on
    the graph alone, so a background worker decides the same)."""
    import torch._inductor.config

    theirs = _theirs(torch._inductor.config.post_grad_custom_pre_pass)
    ours = SCALAR_CHAIN_PASS if not theirs else (*theirs, SCALAR_CHAIN_PASS)
    patch = {**STEP_GRAPH_CONFIG, "post_grad_custom_pre_pass": ours,
             "emulate_precision_casts": emulate_precision_casts()}
    if graph is not None and keeps_all_gathers_apart(graph):
        patch["reorder_for_locality"] = False
    return torch._inductor.config.patch(patch)


def compile_flat(flat_gm: fx.GraphModule, spec: Any, source: fx.GraphModule,
                 inputs: list[Any]) -> InductorModule:
    """Compile a :func:`flat_for_inductor` copy; raises what Inductor raises."""
    from torch._inductor.compile_fx import compile_fx

    from spmd_backend.lowering.handover import stable_cache_keys

    stable_cache_keys()  # the same keys as a background worker's
    t0 = time.perf_counter()
    with step_graph_config(flat_gm.graph), _settled_float_symbols(flat_gm, inputs), \
            aten_kernels_kept():
        compiled = compile_fx(flat_gm, inputs)
    seconds = time.perf_counter() - t0
    log.info("Inductor compiled a %d-node graph in %.1fs", len(source.graph.nodes), seconds)
    return InductorModule(compiled, spec, source, seconds)


def _float_symbols(value: Any) -> set[Any]:
    """The float symbols ``value`` (a node's fake value) refers to."""
    from torch.utils._sympy.symbol import SymT, symbol_is_type

    exprs = []
    for leaf in pytree.tree_leaves(value):  # a node's value, or the list a foreach op returns
        if isinstance(leaf, (torch.SymFloat, torch.SymInt, torch.SymBool)):
            exprs.append(leaf.node.expr)
        elif isinstance(leaf, torch.Tensor):
            exprs.extend(d.node.expr for d in (*leaf.shape, *leaf.stride())
                         if isinstance(d, torch.SymInt))
    return {s for e in exprs for s in getattr(e, "free_symbols", ())
            if symbol_is_type(s, SymT.FLOAT)}


@contextlib.contextmanager
def _settled_float_symbols(flat_gm: fx.GraphModule, inputs: list[Any]) -> Iterator[None]:
    """Within: the float symbols of the inputs' shape environment that no node of ``flat_gm``
    refers to count as settled for AOTAutograd's tensorify pass.

    A Dynamo-door graph comes with Dynamo's fake tensors, whose shape environment still holds
    the symbols of the float inputs Dynamo made dynamic (a scheduler's lr). The first
    AOTAutograd run already turned them into tensor compute (:mod:`spmd_backend.dynamo.float_inputs`),
    so no node of the step graph refers to them; compile_fx's own tensorify pass found them
    neither tensorified nor specialized and asked Dynamo to restart, which cannot happen here:
    the compile failed and the step ran as an fx graph (single-tensor optimizers under a
    scheduler, compiled in this process). A symbol a node still refers to is left alone, so
    tensorify never bakes a value the graph takes as an input. A background worker compiles on
    fresh fake tensors and never sees these symbols.
    """
    from torch._dynamo.symbolic_convert import TensorifyState
    from torch._guards import detect_fake_mode

    fake_mode = detect_fake_mode(inputs)
    shape_env = getattr(fake_mode, "shape_env", None)
    added: list[str] = []
    if shape_env is not None:
        from torch.utils._sympy.symbol import SymT, symbol_is_type

        referenced: set[Any] = set()
        for node in flat_gm.graph.nodes:
            referenced |= _float_symbols(node.meta.get("val"))
        for symbol in list(shape_env.backed_var_to_val):
            if (symbol_is_type(symbol, SymT.FLOAT) and symbol not in referenced
                    and not TensorifyState.should_specialize(str(symbol))):
                TensorifyState.specialize(str(symbol))
                added.append(str(symbol))
    try:
        yield
    finally:
        for name in added:
            TensorifyState.force_specializations.discard(name)


class CacheMiss(SpmdError):
    """Raised inside :func:`cache_only`: the caches do not hold this compile (control flow of
    the background lowering's warm start, never seen by users)."""


@contextlib.contextmanager
def cache_only() -> Iterator[None]:
    """Within: an Inductor compile that AOTAutograd's cache cannot serve (no entry, or an entry
    whose FX-graph cache entry is gone) raises :class:`CacheMiss` instead of compiling (torch
    2.13: ``AOTAutogradCache.try_load`` returns no function on a miss)."""
    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache

    real = AOTAutogradCache.__dict__["try_load"]

    def try_load(*args: Any, **kwargs: Any) -> Any:
        compiled, config = real.__func__(*args, **kwargs)
        if compiled is None:
            raise CacheMiss("the caches hold no compiled code for this graph")
        return compiled, config

    AOTAutogradCache.try_load = staticmethod(try_load)  # type: ignore[method-assign]
    try:
        yield
    finally:
        AOTAutogradCache.try_load = real  # type: ignore[method-assign]


def lower_to_inductor(gm: fx.GraphModule) -> nn.Module:
    """Compile ``gm`` with Inductor; see the module docstring."""
    flat_gm, spec = flat_for_inductor(gm)
    try:
        return compile_flat(flat_gm, spec, gm, example_inputs(flat_gm))
    except SpmdGraphError:
        raise
    except Exception as e:  # noqa: BLE001 - fall back to the fx graph, loudly
        log.warning(
            "Inductor could not compile the step graph (%s: %s); running the fx graph instead",
            type(e).__name__, str(e).splitlines()[0][:300] if str(e) else "",
        )
        return gm


__all__ = [
    "CacheMiss", "EMULATE_CASTS_ENV", "InductorModule", "PASS_OPTIONS", "cache_only", "compile_flat",
    "emulate_precision_casts", "example_inputs", "flat_for_inductor", "lower_to_inductor", "STEP_GRAPH_CONFIG",
    "step_graph_config", "user_passes",
]

