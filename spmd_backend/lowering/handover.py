"""What travels from a training process to its background compile worker.

Requires: a flat step graph as :func:`~spmd_backend.lowering.inductor.flat_for_inductor` makes
it, with fake example inputs, and the :class:`Settings` captured where the graph was lowered.
Guarantees: :func:`make_payload` returns the pickled payload
:mod:`spmd_backend.lowering.compile_worker` reads (the graph serialized on its own by
:mod:`spmd_backend.graph.serialize`, node for node: never ``pickle.dumps(gm)``, which re-traces
the code and ran an AdamW's in-place weight-decay factor ``1 - lr * wd`` on constants at
pickling time, so the worker's code decayed by ``1 - wd``; with only the
attributes it reads; descriptions of its inputs; the rank and size of each process group its
collectives name; the Inductor and AOTAutograd configuration; the process-wide settings
Inductor's cache key reads) and a key that is equal on ranks whose workers would compile the
same graph the same way, or None when the graph or its inputs cannot travel (then the caller
compiles in the foreground).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import operator
import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

from spmd_backend.graph import serialize
from spmd_backend.lowering.compile_worker import tensor_spec

log = logging.getLogger(__name__)


def _memory_format_key(fmt: torch.memory_format) -> tuple[Any, tuple[str]]:
    return str, (str(fmt),)


def stable_cache_keys() -> None:
    """Make AOTAutograd's and Inductor's cache keys the same in every process (torch 2.13).

    A ``torch.memory_format`` has no ``__module__``, so pickle names it by the first module in
    ``sys.modules`` through which ``torch.contiguous_format`` resolves: the user's script or
    ``__mp_main__`` in a training process, a torch module in the worker. The cache keys
    pickle every input's memory format, so the training process missed the entry its worker
    had just written and compiled the whole step again. Both processes call this before
    compiling: the key picklers (and only they: nothing unpickles a key) hash a memory format
    by its name. Idempotent.
    """
    from torch._inductor.codecache import FxGraphCachePickler

    if getattr(FxGraphCachePickler, "_spmd_stable_keys", False):
        return
    init = FxGraphCachePickler.__init__

    @functools.wraps(init)
    def patched(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.dispatch_table[torch.memory_format] = _memory_format_key

    FxGraphCachePickler.__init__ = patched  # type: ignore[method-assign]
    FxGraphCachePickler._spmd_stable_keys = True  # type: ignore[attr-defined]


def group_names(gm: fx.GraphModule) -> list[str]:
    """The process-group names the graph's collectives use, in graph order."""
    names: list[str] = []
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None:
            continue
        for i, arg in enumerate(schema.arguments):
            if arg.name == "group_name":
                name = node.args[i] if i < len(node.args) else node.kwargs.get("group_name")
                if isinstance(name, str) and name not in names:
                    names.append(name)
    return names


def input_specs(vals: list[Any]) -> list[Any] | None:
    """Picklable descriptions of the example inputs, or None when one cannot be described."""
    specs: list[Any] = []
    storages: set[int] = set()
    for v in vals:
        if isinstance(v, torch.Tensor):
            if type(v) not in (torch.Tensor, torch._subclasses.fake_tensor.FakeTensor):
                return None
            key = id(v.untyped_storage())
            if key in storages:
                return None
            storages.add(key)
            specs.append(tensor_spec(v))
        elif isinstance(v, (int, float, bool)) and not isinstance(v, torch.SymInt):
            specs.append(("value", v))
        else:
            return None
    return specs


def portable_copy(gm: fx.GraphModule) -> fx.GraphModule | None:
    """``gm`` as it travels to the worker: only the attributes its graph reads (a Dynamo graph
    also carries unused buffers, which AOTAutograd would lift as inputs), tensor constants
    without elements (an empty key/value cache; fake ones cannot be pickled) as
    ``empty_strided`` calls. None when a fake constant holds data."""
    graph = gm.graph
    attrs: dict[str, Any] = {}
    for node in list(graph.find_nodes(op="get_attr")):
        value = operator.attrgetter(str(node.target))(gm)
        if isinstance(value, torch.Tensor) and value.numel() == 0:
            with graph.inserting_before(node):
                empty = graph.call_function(
                    torch.ops.aten.empty_strided.default,
                    (list(value.shape), list(value.stride())),
                    {"dtype": value.dtype, "device": value.device},
                )
            node.replace_all_uses_with(empty)
            graph.erase_node(node)
            continue
        if isinstance(value, torch._subclasses.fake_tensor.FakeTensor):
            return None
        attrs[str(node.target)] = value
    return fx.GraphModule(attrs, graph)


@dataclass(frozen=True)
class Settings:
    """What a compile of the graph depends on besides the graph, captured where it is lowered
    (a Dynamo compile patches some configuration; the payload may be made calls later)."""

    inductor_config: bytes
    functorch_config: bytes
    process_state: dict[str, Any]


def capture_settings() -> Settings:
    return Settings(torch._inductor.config.save_config(), torch._functorch.config.save_config(),
                    process_state())


@dataclass(frozen=True)
class Payload:
    """What :func:`make_payload` made: the worker's file contents, the key of what it compiles
    (the same on ranks whose worker would compile the same graph the same way: the ranks' own
    places in their groups and CUDA devices left out, Inductor's code does not depend on them),
    and the serialized graph and input descriptions the training process compiles at the switch."""

    data: bytes
    key: str
    graph: bytes
    specs: list[Any]


def make_payload(flat: fx.GraphModule, vals: list[Any], settings: Settings) -> Payload | None:
    """The worker's payload (see :class:`Payload`); None when it cannot be made."""
    specs = input_specs(vals)
    gm = portable_copy(flat) if specs is not None else None
    if gm is None:
        return None
    groups = {}
    for name in group_names(gm):
        pg = dist.distributed_c10d._resolve_process_group(name)
        groups[name] = (pg.rank(), pg.size())
    state = settings.process_state
    configs = {"inductor_config": settings.inductor_config,
               "functorch_config": settings.functorch_config}
    try:
        graph = serialize.dump(gm)
        shared = pickle.dumps({
            "inputs": specs, "group_sizes": {k: v[1] for k, v in groups.items()}, **configs,
            "process_state": {k: v for k, v in state.items() if k != "cuda_device"},
        })
        payload = pickle.dumps({
            "gm": graph, "inputs": specs, "groups": groups, "process_state": state, **configs,
        })
    except Exception as e:  # noqa: BLE001 - a graph that cannot travel compiles in the foreground
        log.info("background compile: the graph cannot be serialized (%s)", e)
        return None
    return Payload(payload, hashlib.sha256(graph + shared).hexdigest(), graph, specs)


def process_state() -> dict[str, Any]:
    """Process-wide settings Inductor's cache key (and its code) depends on, for the worker."""
    matmul = torch.backends.cuda.matmul
    return {
        "num_threads": torch.get_num_threads(),
        "grad_enabled": torch.is_grad_enabled(),
        "deterministic": (torch.are_deterministic_algorithms_enabled(),
                          torch.is_deterministic_algorithms_warn_only_enabled(),
                          torch.utils.deterministic.fill_uninitialized_memory),
        "default_dtype": torch.get_default_dtype(),
        "matmul": (matmul.fp32_precision, matmul.allow_fp16_reduced_precision_reduction,
                   matmul.allow_bf16_reduced_precision_reduction),
        "cuda_device": torch.cuda.current_device() if torch.cuda.is_available() else None,
    }


__all__ = [
    "Payload", "Settings", "capture_settings", "group_names", "input_specs", "make_payload", "portable_copy",
    "process_state", "stable_cache_keys",
]
