"""Warm starts of the Dynamo door: the whole-step compile kept as an AOTAutogradCache entry.

The first call of ``torch.compile(step, backend="spmd")`` spends most of its backend time in
AOTAutograd (two traces of the step) and in the pipeline (expansion, passes). A later process
compiling the same step under the same configuration gets the result from AOTAutograd's own
on-disk cache instead (torch 2.13, "bundled" entries: the compiler's output is stored in the
entry itself, the way ``torch._inductor.output_code.RegionalOutputCode`` is).

What the entry is valid for, and how the key says so:

* the Dynamo graph (code, with placeholder names normalized), the example inputs' metadata,
  grad mode, autocast, AOTAutograd's and Inductor's configuration, torch's version: AOTAutograd's
  own key;
* everything else the backend's compile reads: the :class:`~spmd_backend.pipeline.PipelineConfig`
  (reduce op, bucket cap, passes and their arguments, compression, lowering...) and the passes
  ``SPMD_SKIP_PASSES`` skips, the process group (name, backend, size, ranks, this rank), the kind and FQN of every input (which are parameters,
  buffers, optimizer state), the values of tensors the graph holds as attributes, and the source
  of this package: :func:`digest` hashes them and :func:`insert_key` writes the hash into the
  graph as the argument of a ``spmd_backend::pipeline_key`` no-op, so AOTAutograd's key covers it.
  The pipeline drops that node (:func:`drop_key`).

Not cached (:func:`digest` says why, and the step compiles as before): per-graph mode, graph
dumps requested (``dump_graphs`` or ``SPMD_DUMP_GRAPHS``), a pass that is not this package's (its code is not in the key), a non-simple
option value, a graph attribute over 16 MB, a graph with symbolic shapes, a graph that moves
work into the next iteration, a graph whose targets or values cannot be written
(:mod:`spmd_backend.graph.serialize`). A
corrupt or unreadable entry is a miss (AOTAutograd treats a failed load as a bypass). Torch's
switches turn it off: ``torch._functorch.config.enable_autograd_cache = False`` or
``torch.compiler.config.force_disable_caches = True``.

Requires torch 2.13 (private AOTAutograd cache API; the Dynamo door's whole-step capture is
gated on the same version).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import hashlib
import operator
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch._dynamo.utils import counters
from torch._inductor.output_code import OutputCode

import spmd_backend
from spmd_backend.dynamo.graphs import DynamoInputs
from spmd_backend.errors import SpmdSerializationError
from spmd_backend.graph import serialize
from spmd_backend.iter_graph_module import IterGraphModule
from spmd_backend.lowering.compile_worker import fake_tensor, tensor_spec
from spmd_backend.lowering.handover import stable_cache_keys
from spmd_backend.lowering.inductor import emulate_precision_casts
from spmd_backend.parallel.gloo_all_gather import serialize_all_gathers
from spmd_backend.pass_manager import DUMP_ENV, env_skips, pass_spec_of
from spmd_backend.pipeline import PipelineConfig
from spmd_backend.runtime import GuardedStep
from spmd_backend.tracing.markers import PIPELINE_KEY

#: how the log and errors name the step this door compiles
WHOLE_STEP = 'the backend="spmd" whole step'

#: graph attributes larger than this are not hashed: such a graph is not cached
MAX_HASHED_ATTRIBUTE_BYTES = 16 << 20

_SIMPLE = (str, bool, int, float, type(None))


# ---------------------------------------------------------------------------- the key
@functools.cache
def source_digest() -> str:
    """A hash of this package's version and of every Python file in it."""
    root = Path(spmd_backend.__file__).parent
    h = hashlib.sha256(spmd_backend.__version__.encode())
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


class _NotCacheable(Exception):
    pass


def _pass_identity(p: Any) -> str:
    fn, kwargs = (p[0], p[1]) if isinstance(p, tuple) else (p, {})
    spec = pass_spec_of(fn)
    module = getattr(spec.fn, "__module__", "") or ""
    if not module.startswith("spmd_backend."):
        raise _NotCacheable(f"pass {spec.name!r} is not one of this package's")
    text = f"{spec.name}={module}.{getattr(spec.fn, '__qualname__', '')}{sorted(dict(kwargs).items())!r}"
    if " at 0x" in text:
        raise _NotCacheable(f"pass {spec.name!r} has an argument without a stable value")
    return text


def _simple(name: str, value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return [_simple(name, v) for v in value]
    if not isinstance(value, _SIMPLE):
        raise _NotCacheable(f"option {name}={value!r} is not a plain value")
    return value


def _config_items(config: PipelineConfig) -> list[tuple[str, Any]]:
    if config.dump_graphs or os.environ.get(DUMP_ENV):
        raise _NotCacheable("graph dumps were asked for")
    items: list[tuple[str, Any]] = [("env_skips", sorted(env_skips()))]  # SPMD_SKIP_PASSES
    for f in dataclasses.fields(config.parallel):
        if f.name != "group":
            items.append((f"parallel.{f.name}", _simple(f.name, getattr(config.parallel, f.name))))
    pg = config.parallel.process_group()
    items.append(("group", (pg.group_name, str(dist.get_backend(pg)), pg.size(), pg.rank(),
                            dist.get_process_group_ranks(pg))))
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name in ("parallel", "dump_graphs"):
            continue
        if f.name in ("passes", "extra_passes"):
            value = None if value is None else [_pass_identity(p) for p in value]
        items.append((f.name, _simple(f.name, value)))
    return items


def _attribute_items(gm: fx.GraphModule) -> list[tuple[str, str]]:
    items = []
    for node in gm.graph.find_nodes(op="get_attr"):
        value = operator.attrgetter(str(node.target))(gm)
        if not isinstance(value, torch.Tensor):
            continue
        if isinstance(value, torch._subclasses.fake_tensor.FakeTensor):
            raise _NotCacheable(f"graph attribute {node.target} is a fake tensor")
        if value.numel() * value.element_size() > MAX_HASHED_ATTRIBUTE_BYTES:
            raise _NotCacheable(f"graph attribute {node.target} is over 16 MB")
        data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        items.append((str(node.target), hashlib.sha256(data).hexdigest()))
    return items


def digest(gm: fx.GraphModule, config: PipelineConfig, inputs: DynamoInputs) -> tuple[str | None, str]:
    """``(hash, "")`` of what the compile reads besides the graph (module docstring), or
    ``(None, reason)`` when the step must not be cached."""
    try:
        items: list[Any] = [("source", source_digest()), *_config_items(config),
                            # the lowering's setting from the environment (AOTAutograd's key
                            # holds torch's setting, which the lowering overrides)
                            ("emulate_precision_casts", emulate_precision_casts())]
        items.append(("inputs", sorted(inputs.kinds.items()), sorted(inputs.fqns.items())))
        items.extend(_attribute_items(gm))
    except _NotCacheable as e:
        return None, str(e)
    except Exception as e:  # noqa: BLE001 - whatever cannot be keyed is compiled, not cached
        return None, f"the key could not be made ({type(e).__name__}: {e})"
    return hashlib.sha256(repr(items).encode()).hexdigest(), ""


def insert_key(gm: fx.GraphModule, key: str) -> None:
    """Write ``key`` into ``gm``'s code (a ``pipeline_key`` node before its first computation)."""
    graph = gm.graph
    placeholders = list(graph.find_nodes(op="placeholder"))
    anchor = placeholders[-1] if placeholders else None
    if anchor is None:
        with graph.inserting_before(next(iter(graph.nodes))):
            graph.call_function(PIPELINE_KEY, (key,))
    else:
        with graph.inserting_after(anchor):
            graph.call_function(PIPELINE_KEY, (key,))
    gm.recompile()


def drop_key(graph: fx.Graph) -> None:
    """Remove the ``pipeline_key`` nodes (they hold no data)."""
    for node in list(graph.find_nodes(op="call_function", target=PIPELINE_KEY)):
        graph.erase_node(node)


def blocker(gm: fx.GraphModule) -> str | None:
    """Why AOTAutograd will not cache this Dynamo graph, or None (its own check, run early so
    the log can say it once)."""
    from torch._functorch._aot_autograd.autograd_cache import (
        BypassAOTAutogradCache,
        check_cacheable,
        should_use_local_autograd_cache,
    )

    if not should_use_local_autograd_cache():
        return "AOTAutograd's cache is disabled"
    stable_cache_keys()  # the key of a memory format must not depend on the process's modules
    try:
        check_cacheable(gm)
    except BypassAOTAutogradCache as e:
        return str(e).splitlines()[0]
    except Exception as e:  # noqa: BLE001 - an unexpected graph: say so, do not cache
        return f"{type(e).__name__}: {e}"
    return None


# ---------------------------------------------------------------------------- the entry
def _bypass(reason: str) -> Exception:
    from torch._functorch._aot_autograd.autograd_cache import BypassAOTAutogradCache

    return BypassAOTAutogradCache(f'backend="spmd": {reason}')


def _spec(val: Any) -> Any:
    """A picklable description of a node's example value: tensors (static shapes only, as
    :func:`~spmd_backend.lowering.compile_worker.tensor_spec` describes them) and lists/tuples of
    them; None for anything else (not restored)."""
    if isinstance(val, torch.Tensor):
        if any(isinstance(s, torch.SymInt) for s in (*val.shape, *val.stride())) or isinstance(
            val.storage_offset(), torch.SymInt
        ):
            raise SpmdSerializationError("a value of symbolic shape cannot be stored")
        return tensor_spec(val)
    if isinstance(val, (list, tuple)):
        return ("seq", type(val) is tuple, [_spec(v) for v in val])
    return None


def _value(spec: Any, fake_mode: Any) -> Any:
    """A fake value of ``fake_mode`` from :func:`_spec`'s description (a fake-mode dispatch per
    value would cost 0.2 ms each inside Dynamo's compile)."""
    if spec is None:
        return None
    if spec[0] == "seq":
        values = [_value(s, fake_mode) for s in spec[2]]
        return tuple(values) if spec[1] else values
    return fake_tensor(spec, fake_mode)


class StepOutputCode(OutputCode):
    """The Dynamo door's compiled whole step, as AOTAutograd stores it.

    Live: runs its :class:`IterGraphModule`. Stored: the final graph
    (:mod:`spmd_backend.graph.serialize`), every node's example value as shape, stride, offset,
    dtype and device (the lowering reads placeholders' and fused optimizer arguments' values) and
    the lowering function; :meth:`post_compile` rebuilds the module (and lowers it the same way)."""

    def __init__(self, module: IterGraphModule | None, lower: Callable[..., Any] | None,
                 not_saved: str | None = None, run: Callable[[list[Any]], Any] | None = None) -> None:
        super().__init__()
        self._boxed_call = True
        self.module = module
        self.lower = lower
        self.not_saved = not_saved
        self._run = run
        self._graph: bytes | None = None
        self._specs: list[Any] = []
        #: the module run with the compile door's rollback
        self._guarded = GuardedStep(module, WHOLE_STEP) if module is not None else None

    @classmethod
    def unsaved(cls, run: Callable[[list[Any]], Any], reason: str) -> StepOutputCode:
        """A compiled graph (boxed callable) AOTAutograd must not store."""
        return cls(None, None, not_saved=reason, run=run)

    def __call__(self, inputs: list[Any]) -> Any:
        if self._run is not None:
            return self._run(inputs)
        if self._guarded is None:
            raise RuntimeError("StepOutputCode called before post_compile()")
        return self._guarded(inputs)

    def set_triton_bundle(self, triton_bundle: Any) -> None:
        return None

    def prepare_for_serialization(self) -> None:
        """Runs on AOTAutograd's copy of this object; raising here means "do not store"."""
        if self.not_saved is not None:
            raise _bypass(self.not_saved)
        module = self.module
        if module is None or module.num_moves:
            raise _bypass("a step that moves work into the next iteration is not cached")
        lower = self.lower
        if lower is not None and "<locals>" in getattr(lower, "__qualname__", "<locals>"):
            raise _bypass(f"the lowering {lower!r} cannot be stored")
        source = module.source_module()
        try:
            self._specs = [_spec(n.meta.get("val")) for n in source.graph.nodes]
            self._graph = serialize.dump(source)
        except SpmdSerializationError as e:
            raise _bypass(str(e)) from e
        self.module = None
        self._guarded = None
        counters["spmd"]["step_cache_saved"] += 1

    def post_compile(self, example_inputs: Any, constants: Any, graph_kwargs: Any) -> None:
        """Rebuild the module from a stored entry (a no-op on a live one)."""
        if self.module is not None or self._run is not None:
            return
        if self._graph is None:
            raise RuntimeError("StepOutputCode: an entry without a graph")
        from torch._subclasses.fake_tensor import FakeTensorMode

        gm = serialize.load(self._graph)
        nodes = list(gm.graph.nodes)
        if len(nodes) != len(self._specs):
            raise RuntimeError("StepOutputCode: the stored graph does not match its values")
        # a mode of its own, without a shape environment (the values are static; AOTAutograd's
        # mode records every creation in its shape environment)
        fake_mode = FakeTensorMode()
        for node, spec in zip(nodes, self._specs):
            if spec is not None:
                node.meta["val"] = _value(spec, fake_mode)
        module = IterGraphModule(gm, lower=self.lower, legalize=serialize_all_gathers)
        with _as_outside():
            module.finalize_setup()
        self.module = module
        self._guarded = GuardedStep(module, WHOLE_STEP)
        counters["spmd"]["step_cache_hits"] += 1


# ---------------------------------------------------------------------------- AOT glue
def compilers(
    whole: Callable[[fx.GraphModule, list[Any]], IterGraphModule],
    forward: Callable[[fx.GraphModule, list[Any]], Any],
    backward: Callable[[fx.GraphModule, list[Any]], Any],
    lower: Callable[..., Any] | None,
) -> dict[str, Any]:
    """``aot_autograd`` keyword arguments whose compilers AOTAutograd may cache: the whole-step
    (inference) compiler's result is stored; a training graph's never is (per-graph compiles
    inside a whole-step frame are unexpected and stay uncached)."""
    from torch._functorch._aot_autograd.schemas import SerializableAOTDispatchCompiler

    def whole_code(g: fx.GraphModule, ex: list[Any]) -> StepOutputCode:
        with _as_outside():
            return StepOutputCode(whole(g, ex), lower)

    def unsaved(fn: Callable[..., Any], what: str) -> Callable[..., StepOutputCode]:
        def compile_(g: fx.GraphModule, ex: list[Any]) -> StepOutputCode:
            return StepOutputCode.unsaved(fn(g, ex), f"a {what} graph is not cached")
        return compile_

    return {
        "fw_compiler": SerializableAOTDispatchCompiler(StepOutputCode, unsaved(forward, "forward")),
        "bw_compiler": SerializableAOTDispatchCompiler(StepOutputCode, unsaved(backward, "backward")),
        "inference_compiler": SerializableAOTDispatchCompiler(StepOutputCode, whole_code),
    }


#: the ``bundled_autograd_cache`` setting outside :func:`bundled`
_OUTSIDE: contextvars.ContextVar[bool] = contextvars.ContextVar("spmd_bundled_outside", default=False)


@contextlib.contextmanager
def bundled() -> Iterator[None]:
    """AOTAutograd stores the compiler's output in its entry (what :class:`StepOutputCode` needs)."""
    token = _OUTSIDE.set(bool(torch._functorch.config.bundled_autograd_cache))
    try:
        with torch._functorch.config.patch(bundled_autograd_cache=True):
            yield
    finally:
        _OUTSIDE.reset(token)


def _as_outside() -> Any:
    """The user's own setting again, for the pipeline's lowering (an Inductor compile, now or in a
    background worker, must not depend on whether its step came from this cache)."""
    return torch._functorch.config.patch(bundled_autograd_cache=_OUTSIDE.get())


def hits() -> int:
    """Compiled steps served from the cache so far in this process (``counters["spmd"]``
    ``["step_cache_hits"]``; ``["step_cache_saved"]`` counts the steps handed to AOTAutograd's
    cache to store)."""
    return int(counters["spmd"]["step_cache_hits"])


__all__ = [
    "MAX_HASHED_ATTRIBUTE_BYTES", "StepOutputCode", "blocker", "bundled", "compilers", "digest",
    "drop_key", "hits", "insert_key", "source_digest",
]
