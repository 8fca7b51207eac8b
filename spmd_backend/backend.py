"""``torch.compile(step, backend="spmd")``: the Dynamo front door to the same pipeline.

Registered through the ``torch_dynamo_backends`` entry point of this package (never by import,
which would make torch's lookup fail with a duplicate name), so a process that never imports
spmd_backend can use it. Dynamo hands each captured graph to :func:`spmd_dynamo_backend`:

* the graph goes through AOTAutograd (Inductor's ``compile_fx``, or ``aot_autograd`` without
  Inductor); in the **backward** graph every output whose descriptor is
  ``GradAOTOutput(grad_of=PlainAOTInput(i))`` for a graph input ``i`` that is an
  ``nn.Parameter`` is replaced by ``wait_tensor(all_reduce(grad))`` (mean by default: this door
  replaces DDP), then the same PassManager runs the same passes (bucketing, wait scheduling)
  and the graph is lowered;
* module buffers read by a forward graph are broadcast from the group's first rank at its start
  (DDP's ``broadcast_buffers``), and parameters and buffers are broadcast once when first seen
  (DDP's constructor);
* every node is annotated with its phase and module FQN (from Dynamo's ``nn_module_stack``);
* graphs without parameters (the optimizer step, which Dynamo compiles as its own graphs) are
  simply compiled.

A parameter whose gradient reaches ``.grad`` without passing through a compiled backward (a graph
break inside the model ran part of it eagerly) raises :class:`~spmd_backend.errors.SpmdUsageError`
during ``backward()`` instead of training unsynchronized.

Options (``torch.compile(..., options={...})``): ``reduce_op`` ("avg"|"sum"), ``bucket_size_mb``,
``process_group``, ``passes`` (names or pass objects, default bucketing + wait scheduling; ``[]``
for none), ``inductor`` (bool), ``dump_graphs`` (a folder, or True for a new temporary one),
``broadcast_buffers`` (bool). Unknown options are an error naming the valid ones.
"""

from __future__ import annotations

import logging
import re
import tempfile
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from spmd_backend.errors import SpmdUsageError
from spmd_backend.graph import ops
from spmd_backend.graph.meta import Phase, annotate, annotated, owner_of
from spmd_backend.graph.utils import dump_graphs_to_files, get_output
from spmd_backend.parallel.data_parallel import DataParallel, add_collective
from spmd_backend.pass_manager import PassManager
from spmd_backend.passes import default_pipeline

log = logging.getLogger(__name__)
c10d = torch.ops._c10d_functional

DEFAULT_OPTIONS: dict[str, Any] = {
    "reduce_op": "avg",
    "bucket_size_mb": 25.0,
    "process_group": None,
    "passes": None,
    "inductor": True,
    "dump_graphs": False,
    "broadcast_buffers": True,
}


@dataclass
class BackendConfig:
    """Validated ``options`` of ``torch.compile(..., backend="spmd", options=...)``."""

    reduce_op: str = "avg"
    bucket_size_mb: float = 25.0
    process_group: Any = None
    passes: list[Any] = field(default_factory=list)
    inductor: bool = True
    dump_folder: str | None = None
    broadcast_buffers: bool = True

    @classmethod
    def from_options(cls, options: dict[str, Any] | None) -> BackendConfig:
        options = dict(options or {})
        unknown = sorted(set(options) - set(DEFAULT_OPTIONS))
        if unknown:
            raise SpmdUsageError(
                f'torch.compile(backend="spmd"): unknown option(s) {unknown}; valid options are '
                f"{sorted(DEFAULT_OPTIONS)}"
            )
        merged = {**DEFAULT_OPTIONS, **options}
        DataParallel(reduce_op=merged["reduce_op"])  # validates the reduce op
        bucket = merged["bucket_size_mb"]
        if not isinstance(bucket, (int, float)) or bucket <= 0:
            raise SpmdUsageError(f'backend="spmd": bucket_size_mb must be a positive number, got {bucket!r}')
        passes = merged["passes"]
        if passes is None:
            passes = default_pipeline(float(bucket), with_optimizer=False)
        dump = merged["dump_graphs"]
        folder = tempfile.mkdtemp(prefix="spmd_dynamo_") if dump is True else (dump or None)
        return cls(
            reduce_op=merged["reduce_op"],
            bucket_size_mb=float(bucket),
            process_group=merged["process_group"],
            passes=list(passes),
            inductor=bool(merged["inductor"]),
            dump_folder=folder,
            broadcast_buffers=bool(merged["broadcast_buffers"]),
        )

    def mode(self) -> DataParallel:
        return DataParallel(reduce_op=self.reduce_op, group=self.process_group)


_SOURCE_PART = re.compile(r"\._(?:modules|parameters|buffers)\['([^']+)'\]|\.([A-Za-z_]\w*)|\[(\d+)\]|\['([^']+)'\]")


def source_fqn(source_name: str) -> str:
    """``L['model']._modules['0']._parameters['weight']`` -> ``0.weight`` (root stripped)."""
    head = re.match(r"^L\['[^']+'\]|^G\['[^']+'\]|^[A-Za-z_]\w*", source_name)
    rest = source_name[head.end():] if head else source_name
    parts = [next(g for g in m.groups() if g is not None) for m in _SOURCE_PART.finditer(rest)]
    return ".".join(parts)


@dataclass
class _GraphInputs:
    params: dict[int, nn.Parameter]
    param_fqns: dict[int, str]
    buffers: dict[int, torch.Tensor]


def _inputs_of(gm: fx.GraphModule) -> _GraphInputs:
    params: dict[int, nn.Parameter] = {}
    fqns: dict[int, str] = {}
    buffers: dict[int, torch.Tensor] = {}
    for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        grapharg = node.meta.get("grapharg")
        example = getattr(grapharg, "example", None)
        name = grapharg.source.name if grapharg is not None and grapharg.source is not None else ""
        if isinstance(example, nn.Parameter):
            params[i] = example
            fqns[i] = source_fqn(name)
        elif isinstance(example, torch.Tensor) and "._buffers[" in name:
            buffers[i] = example
    return _GraphInputs(params, fqns, buffers)


# ----------------------------------------------------------------------------- unreduced grads
class _TensorTable:
    """Per-tensor values keyed by identity, dropped when the tensor dies.

    (``weakref.WeakKeyDictionary`` compares tensor keys with ``==``, which is elementwise.)
    """

    def __init__(self) -> None:
        self._data: dict[int, Any] = {}

    def get(self, t: torch.Tensor, default: Any = None) -> Any:
        return self._data.get(id(t), default)

    def set(self, t: torch.Tensor, value: Any) -> None:
        if id(t) not in self._data:
            weakref.finalize(t, self._data.pop, id(t), None)
        self._data[id(t)] = value

    def __contains__(self, t: torch.Tensor) -> bool:
        return id(t) in self._data


_HOOKED = _TensorTable()
_REDUCED = _TensorTable()  # pending accumulations of reduced gradients, per parameter
_REDUCED_SINCE_STEP = _TensorTable()  # reduced at least once since the last optimizer step
_SYNCED = _TensorTable()


def _guard(param: nn.Parameter, fqn: str) -> None:
    if param in _HOOKED:
        return

    def check(p: torch.Tensor) -> None:
        pending = _REDUCED.get(p, 0)
        if pending > 0:
            _REDUCED.set(p, pending - 1)
            return
        raise SpmdUsageError(
            f'backend="spmd": the gradient of parameter {fqn!r} was computed outside the '
            "spmd-compiled graphs (a graph break inside the model ran part of it eagerly), so it "
            "would not be synchronized across ranks; remove the graph break "
            "(torch._dynamo.explain shows it) or compile the model with fullgraph=True"
        )

    _HOOKED.set(param, param.register_post_accumulate_grad_hook(check))


def _mark_reduced(params: list[nn.Parameter]) -> None:
    for p in params:
        _REDUCED.set(p, _REDUCED.get(p, 0) + 1)
        _REDUCED_SINCE_STEP.set(p, True)


def _checked_optimizer_step(compiled: Any, params: list[nn.Parameter]) -> Any:
    """Before an optimizer-step graph runs: every parameter with a gradient must have been
    reduced since the last step (catches parameters used only in eager regions)."""
    refs = [(weakref.ref(p), i) for i, p in enumerate(params)]

    def run(*args: Any) -> Any:
        for ref, i in refs:
            p = ref()
            if p is None or p.grad is None:
                continue
            if not _REDUCED_SINCE_STEP.get(p, False):
                raise SpmdUsageError(
                    f'backend="spmd": optimizer parameter #{i} (shape {list(p.shape)}) has a '
                    "gradient that no spmd-compiled backward reduced (a graph break inside the "
                    "model ran it eagerly?); it would not be synchronized across ranks. Remove "
                    "the graph break (torch._dynamo.explain shows it)"
                )
            _REDUCED_SINCE_STEP.set(p, False)
        return compiled(*args)

    return run


# ----------------------------------------------------------------------------- graph rewriting
def _annotate_all(graph: fx.Graph, phase: Phase) -> None:
    for node in graph.nodes:
        if annotated(node):
            continue
        if node.op == "placeholder":
            annotate(node, fqn=None, phase=Phase.INPUT)
        elif node.op == "output":
            annotate(node, fqn=None, phase=Phase.OUTPUT)
        else:
            stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
            fqn = source_fqn(list(stack.values())[-1][0]) if stack else None
            annotate(node, fqn=fqn, phase=Phase.COMM if ops.is_collective(node) or ops.is_wait(node) else phase)


def _broadcast_buffers(gm: fx.GraphModule, inputs: _GraphInputs, group_name: str) -> int:
    """Overwrite each buffer the graph reads with the group's first rank's, before any use
    (DDP's ``broadcast_buffers``): ``buf.copy_(wait(broadcast(buf)))`` at the graph start."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    count = 0
    anchor = placeholders[-1]
    for i in inputs.buffers:
        buf = placeholders[i]
        if not buf.users:
            continue
        with gm.graph.inserting_after(anchor):
            b = gm.graph.call_function(c10d.broadcast.default, (buf, 0, group_name))
        with gm.graph.inserting_after(b):
            w = gm.graph.call_function(c10d.wait_tensor.default, (b,))
        with gm.graph.inserting_after(w):
            anchor = gm.graph.call_function(torch.ops.aten.copy_.default, (buf, w))
        for n in (b, w, anchor):
            if "example_value" in buf.meta:
                n.meta["example_value"] = buf.meta["example_value"]
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def insert_gradient_collectives(
    graph: fx.Graph, inputs: _GraphInputs, reduce_op: str, group_name: str
) -> list[int]:
    """Reduce every parameter gradient the backward graph outputs; returns the input indices."""
    from torch._functorch._aot_autograd.descriptors import GradAOTOutput, PlainAOTInput

    out = get_output(graph)
    descs = out.meta.get("desc")
    if descs is None:
        raise SpmdUsageError(
            'backend="spmd": the backward graph carries no output descriptors; this torch build '
            "is not supported (torch 2.13 is required)"
        )
    values = list(out.args[0])
    reduced: list[int] = []
    for pos, (value, desc) in enumerate(zip(values, descs)):
        if not isinstance(value, fx.Node) or not isinstance(desc, GradAOTOutput):
            continue
        base = desc.grad_of
        if not isinstance(base, PlainAOTInput) or base.idx not in inputs.params:
            continue
        fqn = inputs.param_fqns[base.idx]
        wait = add_collective(
            graph, value, c10d.all_reduce.default, (reduce_op, group_name),
            name="all_reduce", owner=owner_of(fqn), params=[fqn],
        )
        values[pos] = wait
        reduced.append(base.idx)
    out.args = (tuple(values),) + tuple(out.args[1:])
    graph.lint()
    return reduced


def upcast_scalar_pows(gm: fx.GraphModule, example_inputs: list[Any]) -> int:
    """``beta ** step`` on 0-dim float32 step tensors computed in float64 (see
    :mod:`spmd_backend.tracing.dispatch`): torch.compile's optimizers otherwise lose five digits
    in ``1 - 0.999 ** t``. Re-propagates fake values when anything changed."""
    graph = gm.graph
    changed = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in ops.SCALAR_POW_TARGETS:
            continue
        exponent = node.args[1]
        elems = exponent if isinstance(exponent, (list, tuple)) else [exponent]
        new_elems = []
        for e in elems:
            val = e.meta.get("val") if isinstance(e, fx.Node) else None
            if isinstance(val, torch.Tensor) and val.dim() == 0 and val.dtype == torch.float32:
                with graph.inserting_before(node):
                    e = graph.call_function(torch.ops.prims.convert_element_type.default, (e, torch.float64))
                changed += 1
            new_elems.append(e)
        node.args = (node.args[0], new_elems if isinstance(exponent, (list, tuple)) else new_elems[0], *node.args[2:])
    if changed:
        from torch._guards import detect_fake_mode
        from torch.fx.passes.fake_tensor_prop import FakeTensorProp

        graph.lint()
        gm.recompile()
        mode = detect_fake_mode(example_inputs)
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*example_inputs)
    return changed


# ----------------------------------------------------------------------------- the backend
def _boxed_with_marks(compiled: Any, params: list[nn.Parameter]) -> Any:
    refs = [weakref.ref(p) for p in params]

    def run(args: list[Any]) -> Any:
        out = compiled(args)
        _mark_reduced([p for p in (r() for r in refs) if p is not None])
        return out

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _prepare_backward(gm: fx.GraphModule, cfg: BackendConfig, inputs: _GraphInputs, group_name: str,
                      tag: str) -> list[int]:
    reduced = insert_gradient_collectives(gm.graph, inputs, cfg.reduce_op, group_name)
    _annotate_all(gm.graph, Phase.BACKWARD)
    if cfg.dump_folder:
        dump_graphs_to_files({f"{tag}.backward.expanded": gm.graph}, cfg.dump_folder)
    if reduced and cfg.passes:
        PassManager(cfg.passes, dump_dir=cfg.dump_folder).run(gm)
    gm.recompile()
    return reduced


def spmd_dynamo_backend(gm: fx.GraphModule, example_inputs: list[Any], options: dict[str, Any] | None = None) -> Any:
    """The Dynamo backend registered as "spmd" (see the module docstring)."""
    cfg = BackendConfig.from_options(options)
    mode = cfg.mode()
    group_name = mode.group_name()  # raises on every rank without a process group
    inputs = _inputs_of(gm)
    pg = mode.process_group()
    import torch.distributed as dist

    for t in [*inputs.params.values(), *inputs.buffers.values()]:
        if t not in _SYNCED and dist.get_world_size(pg) > 1:
            with torch.no_grad():
                dist.broadcast(t.detach(), src=mode.src_rank(), group=pg)
            _SYNCED.set(t, True)
    for i, p in inputs.params.items():
        if p.requires_grad:
            _guard(p, inputs.param_fqns[i])
    if cfg.broadcast_buffers and inputs.buffers:
        _broadcast_buffers(gm, inputs, group_name)
    tag = f"g{id(gm) % 100000}"
    if cfg.dump_folder:
        log.warning('backend="spmd": dumping graphs to %s', cfg.dump_folder)
        dump_graphs_to_files({f"{tag}.dynamo": gm.graph}, cfg.dump_folder)
    sources = [
        n.meta["grapharg"].source.name
        for n in gm.graph.nodes
        if n.op == "placeholder" and n.meta.get("grapharg") is not None and n.meta["grapharg"].source
    ]
    if any(name.endswith(".grad") for name in sources):  # an optimizer-step graph
        step_params = [p for p in gm.parameters() if isinstance(p, nn.Parameter)]
        step_params += [p for p in inputs.params.values()]
        compiled = _compile_plain(gm, example_inputs, cfg, inputs, group_name, tag)
        return _checked_optimizer_step(compiled, step_params)
    return _compile_plain(gm, example_inputs, cfg, inputs, group_name, tag)


def _compile_plain(gm: fx.GraphModule, example_inputs: list[Any], cfg: BackendConfig,
                   inputs: _GraphInputs, group_name: str, tag: str) -> Any:
    if cfg.inductor:
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        def inner(g: fx.GraphModule, ex: list[Any], **kw: Any) -> Any:
            if kw.get("is_backward"):
                reduced = _prepare_backward(g, cfg, inputs, group_name, tag)
                compiled = compile_fx_inner(g, ex, **kw)
                return _boxed_with_marks(compiled, [inputs.params[i] for i in reduced])
            _annotate_all(g.graph, Phase.FORWARD)
            if not inputs.params:
                upcast_scalar_pows(g, ex)
            return compile_fx_inner(g, ex, **kw)

        return compile_fx(gm, example_inputs, inner_compile=inner)

    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def fw(g: fx.GraphModule, ex: list[Any]) -> Any:
        _annotate_all(g.graph, Phase.FORWARD)
        if not inputs.params:
            upcast_scalar_pows(g, ex)
        return make_boxed_func(g.forward)

    def bw(g: fx.GraphModule, ex: list[Any]) -> Any:
        reduced = _prepare_backward(g, cfg, inputs, group_name, tag)
        return _boxed_with_marks(make_boxed_func(g.forward), [inputs.params[i] for i in reduced])

    return aot_autograd(fw_compiler=fw, bw_compiler=bw)(gm, example_inputs)


__all__ = ["BackendConfig", "insert_gradient_collectives", "source_fqn", "spmd_dynamo_backend"]
