"""Lower a step graph with Inductor in a background process; run the fx graph until it is ready.

Requires: a graph as :func:`~spmd_backend.lowering.inductor.lower_to_inductor` takes it, and an
Inductor FX-graph cache (``torch._inductor.config.fx_graph_cache``, on by default) that this
process and its child share (``TORCHINDUCTOR_CACHE_DIR``). Guarantees:

- :func:`lower_in_background` returns at once a :class:`BackgroundLowered` module, called exactly
  like the graph. Its first call runs the fx graph; its second starts a worker process
  (``python -m spmd_backend.lowering.compile_worker``) that compiles the same graph (a pickled
  copy, the same Inductor and AOTAutograd configuration, fake inputs, a fake process group under
  each collective's group name) and so fills the cache. A graph called once (a setup graph) never
  starts one.
- Every call before the switch runs the fx graph: the same graph, the same collectives, fx's
  eager kernels. When the worker has finished, this process compiles the identical copy, which
  is a cache hit (seconds), and the ranks of the graph's process group agree, with one small
  all_reduce per call until they do, to switch on the same call: replicas never run different
  kernels for the same step. A worker that fails, or a load that fails, on any rank keeps every
  rank on the fx graph, with one warning that says why.
- Whatever runs, results are those of the graph (fx's or Inductor's rounding; which call switches
  depends on how fast the worker compiles, so runs are reproducible only to rounding: pass
  ``background_compile=False`` for the blocking compile).
- :func:`pending` counts the modules of this process whose worker has started and whose switch
  is still open (the same on every rank after each call); :func:`wait_for_background` blocks
  until their workers have finished; a worker is killed when its module is garbage-collected.

Falls back to the blocking :func:`lower_to_inductor` (logged) where a background compile cannot
hand its result over: the cache switched off, an input that is not a plain tensor or number,
inputs that share storage, a fake tensor constant with elements (constants without elements,
such as an empty key/value cache, become ``empty_strided`` calls), a graph that cannot be
pickled.
"""

from __future__ import annotations

import logging
import operator
import os
import pathlib
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

from spmd_backend.lowering.compile_worker import fake_inputs
from spmd_backend.lowering.inductor import (
    InductorModule,
    compile_flat,
    example_inputs,
    flat_for_inductor,
    lower_to_inductor,
)

log = logging.getLogger(__name__)

_PACKAGE_ROOT = str(pathlib.Path(__file__).resolve().parents[2])
_LIVE: weakref.WeakSet[BackgroundLowered] = weakref.WeakSet()

COMPILING, COMPILED, FAILED = "compiling", "compiled", "failed"
#: what the worker process runs (``python -m``)
WORKER_MODULE = "spmd_backend.lowering.compile_worker"


def _group_names(gm: fx.GraphModule) -> list[str]:
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


def _input_specs(vals: list[Any]) -> list[Any] | None:
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
            specs.append(("tensor", tuple(v.shape), tuple(v.stride()), v.storage_offset(),
                          v.dtype, str(v.device), v.requires_grad))
        elif isinstance(v, (int, float, bool)) and not isinstance(v, torch.SymInt):
            specs.append(("value", v))
        else:
            return None
    return specs


def _portable_copy(gm: fx.GraphModule) -> fx.GraphModule | None:
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


def _payload(flat: fx.GraphModule, vals: list[Any]) -> bytes | None:
    specs = _input_specs(vals)
    gm = _portable_copy(flat) if specs is not None else None
    if gm is None:
        return None
    groups = {}
    for name in _group_names(gm):
        pg = dist.distributed_c10d._resolve_process_group(name)
        groups[name] = (pg.rank(), pg.size())
    try:
        return pickle.dumps({
            "gm": gm, "inputs": specs, "groups": groups,
            "inductor_config": torch._inductor.config.save_config(),
            "process_state": process_state(),
            "functorch_config": torch._functorch.config.save_config(),
        })
    except Exception as e:  # noqa: BLE001 - an unpicklable graph compiles in the foreground
        log.info("background compile: the graph cannot be pickled (%s)", e)
        return None


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


def _stop(proc: subprocess.Popen[bytes] | None, folder: str) -> None:
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()
    shutil.rmtree(folder, ignore_errors=True)


class BackgroundLowered(nn.Module):
    """The fx graph until the background compile is in and agreed; Inductor's code after."""

    def __init__(self, gm: fx.GraphModule, spec: Any, payload: bytes) -> None:
        super().__init__()
        self.source = gm
        self.graph = gm.graph
        # what this process compiles is the worker's copy: a pickle round trip renames nodes
        # the way unpickling does, so both compute the same cache key
        # (outside the fake mode a Dynamo compile runs this in: its constants must be real)
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            copy = pickle.loads(payload)  # noqa: S301 - our own bytes
        self._flat: fx.GraphModule | None = copy["gm"]
        self._specs: list[Any] = copy["inputs"]
        self._configs = (pickle.loads(copy["inductor_config"]),  # noqa: S301
                         pickle.loads(copy["functorch_config"]))  # noqa: S301
        self._grad_enabled: bool = copy["process_state"]["grad_enabled"]
        self._spec, self._payload = spec, payload
        # the ranks agree on the first group the graph's collectives name (None: no collectives)
        self._group_name: str | None = next(iter(copy["groups"]), None)
        self._folder = tempfile.mkdtemp(prefix="spmd_lowering_")
        self._proc: subprocess.Popen[bytes] | None = None
        self._launched = False  # the switch is open from here on (even if the launch failed)
        self._compiled: InductorModule | None = None
        self._local = COMPILING
        self._why = ""
        self.state = COMPILING
        self.calls = 0
        self.switched_at_call: int | None = None
        self._started = 0.0
        self._finalizer = weakref.finalize(self, _stop, None, self._folder)
        _LIVE.add(self)

    # ------------------------------------------------------------------ worker
    def _start(self) -> None:
        self._launched = True
        try:
            self._launch()
        except OSError as e:  # decided with the other ranks on the next call, like any failure
            self._local, self._why = FAILED, f"the compile worker could not start: {e}"

    def _launch(self) -> None:
        path = os.path.join(self._folder, "graph.pkl")
        with open(path, "wb") as f:
            f.write(self._payload)
        self._payload = b""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
        self._log = open(os.path.join(self._folder, "worker.log"), "wb")  # noqa: SIM115
        self._proc = subprocess.Popen(
            [sys.executable, "-m", WORKER_MODULE, path],
            stdout=self._log, stderr=subprocess.STDOUT, env=env,
        )
        self._started = time.perf_counter()
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _stop, self._proc, self._folder)
        log.info("compiling the step graph with Inductor in the background (pid %d); the fx "
                 "graph runs meanwhile", self._proc.pid)

    def _worker_error(self) -> str:
        """The worker's last line, and where its whole log is kept."""
        self._log.close()
        fd, kept = tempfile.mkstemp(prefix="spmd_compile_worker_", suffix=".log")
        os.close(fd)
        shutil.move(os.path.join(self._folder, "worker.log"), kept)
        text = pathlib.Path(kept).read_text(errors="replace").strip()
        lines = [ln for ln in text.splitlines() if ln.strip()]
        return f"{lines[-1][:300] if lines else 'no output'} (worker log: {kept})"

    def _advance_local(self) -> None:
        """Move this rank's state on: load the worker's result once it has finished."""
        if self._local != COMPILING or self._proc is None or self._proc.poll() is None:
            return
        if self._proc.returncode != 0:
            self._local, self._why = FAILED, f"the compile worker failed: {self._worker_error()}"
            return
        self._log.close()
        hits = torch._dynamo.utils.counters["inductor"]["fxgraph_cache_hit"]
        try:
            # as the worker did: the configuration and grad mode the graph was handed over
            # with (a Dynamo compile patches some), fresh fake tensors from the same
            # descriptions, outside whatever tracing context (Dynamo's runtime wrapper) and
            # fake mode this call is in
            with torch._inductor.config.patch(self._configs[0]), \
                    torch._functorch.config.patch(self._configs[1]), \
                    torch._guards.tracing(None), \
                    torch.set_grad_enabled(self._grad_enabled), \
                    torch._subclasses.fake_tensor.unset_fake_temporarily():
                inputs = fake_inputs(self._specs)
                assert self._flat is not None
                self._compiled = compile_flat(self._flat, self._spec, self.source, inputs)
        except Exception as e:  # noqa: BLE001 - stay on the fx graph, loudly
            self._local, self._why = FAILED, f"{type(e).__name__}: {str(e)[:300]}"
            return
        if torch._dynamo.utils.counters["inductor"]["fxgraph_cache_hit"] == hits:
            log.warning("background compile: its cache entry was not used; this process "
                        "compiled the graph again")
        self._local = COMPILED

    def _agree(self) -> tuple[bool, bool]:
        """(every rank compiled, some rank failed), the same answer on every rank."""
        flags = [int(self._local == COMPILED), int(self._local == FAILED)]
        if self._group_name is None:
            return bool(flags[0]), bool(flags[1])
        pg = dist.distributed_c10d._resolve_process_group(self._group_name)
        device = torch.device("cuda", torch.cuda.current_device()) if (
            dist.get_backend(pg) == "nccl") else torch.device("cpu")
        t = torch.tensor(flags, dtype=torch.int32, device=device)
        dist.all_reduce(t, group=pg)
        ready, failed = (int(x) for x in t.tolist())
        return ready == pg.size(), failed > 0

    def _settle(self) -> None:
        self._advance_local()
        all_ready, any_failed = self._agree()
        if any_failed:
            self.state = FAILED
            why = self._why or "it failed on another rank"
            log.warning("Inductor could not compile the step graph in the background (%s); "
                        "running the fx graph instead", why)
            _stop(self._proc, self._folder)
            self._compiled = self._flat = None
        elif all_ready:
            self.state = COMPILED
            self.switched_at_call = self.calls
            log.info("switched to Inductor's code at call %d, %.1fs after the compile started",
                     self.calls, time.perf_counter() - self._started)
            _stop(None, self._folder)
            self._flat = None

    # ------------------------------------------------------------------ running
    def forward(self, *args: Any) -> Any:
        if self.state == COMPILED:
            return self._compiled(*args)  # type: ignore[misc]
        if self.state == COMPILING:
            if not self._launched:
                if self.calls >= 1:
                    self._start()
            else:
                self._settle()
                if self.state == COMPILED:
                    self.calls += 1
                    return self._compiled(*args)  # type: ignore[misc]
        self.calls += 1
        return self.source(*args)


def pending() -> int:
    """How many background compiles of this process have a worker and no decision yet."""
    return sum(1 for m in list(_LIVE) if m.state == COMPILING and m._launched)


def wait_for_background(timeout: float | None = None) -> None:
    """Block until the workers this process started have finished (benchmarks and tests: the
    switch itself still happens on the next call, agreed by the ranks)."""
    for module in list(_LIVE):
        if module._proc is not None:
            module._proc.wait(timeout)


def lower_in_background(gm: fx.GraphModule) -> nn.Module:
    """Lower ``gm`` with Inductor in a background process; see the module docstring."""
    if not torch._inductor.config.fx_graph_cache:
        log.info("background compile needs Inductor's FX graph cache; compiling now")
        return lower_to_inductor(gm)
    flat, spec = flat_for_inductor(gm)
    vals = example_inputs(flat)
    payload = _payload(flat, vals)
    if payload is None:
        log.info("background compile: inputs or graph cannot be handed to a worker; compiling now")
        return lower_to_inductor(gm)
    return BackgroundLowered(gm, spec, payload)


__all__ = [
    "WORKER_MODULE", "BackgroundLowered", "lower_in_background", "pending", "wait_for_background",
]
