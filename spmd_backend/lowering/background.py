"""Lower a step graph with Inductor in a background process; run the fx graph until it is ready.

Requires: a graph as :func:`~spmd_backend.lowering.inductor.lower_to_inductor` takes it, and an
Inductor FX-graph cache (``torch._inductor.config.fx_graph_cache``, on by default) that this
process and its child share (``TORCHINDUCTOR_CACHE_DIR``). Guarantees:

- Without the FX-graph cache, or with graph passes set in ``torch._inductor.config`` (which a
  worker cannot receive: ``save_config()`` leaves them out), :func:`lower_in_background`
  compiles in this process, as :func:`~spmd_backend.lowering.inductor.lower_to_inductor` does,
  and logs why (both are process-wide settings a training script sets alike on every rank).
- :func:`lower_in_background` returns at once a :class:`BackgroundLowered` module, called exactly
  like the graph (it only records the configuration in force). Its first call runs the fx graph;
  its second makes the copy Inductor compiles and starts a worker process
  (``python -m spmd_backend.lowering.compile_worker``) that compiles the same graph (a
  serialized copy, node for node, the same Inductor and AOTAutograd configuration, fake inputs, a fake process group under
  each collective's group name) and so fills the cache. A graph called once (a setup graph)
  never pays for the copy or a worker.
- One worker per host and graph: on that second call the ranks running the same graph post to
  the c10d store the key of what their worker would compile
  (:func:`~spmd_backend.lowering.handover.make_payload`) with their host name and Inductor cache
  folder; of each set of ranks with all three equal, the lowest compiles and the others wait for
  its worker's status file, then load the same cache entry. (8 ranks on a node compile once,
  not 8 times on the cores training uses.) How the ranks agree, without a collective, is
  :mod:`spmd_backend.lowering.agreement`'s: a graph only one rank has (its batch alone changed)
  must never issue one.
- A warm start switches at once: on that second call each rank first compiles the copy from
  AOTAutograd's and Inductor's caches alone (:func:`~spmd_backend.lowering.inductor.cache_only`:
  a miss raises instead of compiling, so a cold start loses only the key computation); when
  every rank found it (their entries say so), all run Inductor's code from that call on and
  no worker starts. Otherwise the worker path below runs (a rank that found it is simply ready).
- Every call before the switch runs the fx graph: the same graph, the same collectives, fx's
  eager kernels. When the worker has finished, this process compiles the identical copy, which
  is a cache hit (seconds); the ranks running the graph switch on the same call, the one after
  the last of them became ready: replicas never run different kernels for the same step of the
  same graph. A worker that fails (the one a rank waits on included), or a load that fails, on
  any rank keeps every rank on the fx graph, with one warning that says why.
- Whatever runs, results are those of the graph (fx's or Inductor's rounding; which call switches
  depends on how fast the worker compiles, so runs are reproducible only to rounding: pass
  ``background_compile=False`` for the blocking compile).
- :func:`pending` counts the modules of this process whose worker has started and whose switch
  is still open; :func:`wait_for_background` blocks until their workers have finished; a worker
  is killed when its module is garbage-collected.

Falls back to the blocking :func:`lower_to_inductor` (logged) where a background compile cannot
hand its result over: the cache switched off (at once), or, on the second call, on a rank whose
graph has an input that is not a plain tensor or number, inputs that share storage, a fake
tensor constant with elements (constants without elements, such as an empty key/value cache,
become ``empty_strided`` calls), or cannot be serialized.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from spmd_backend.graph import serialize
from spmd_backend.lowering.agreement import READY, Entry, SwitchAgreement, graph_identity
from spmd_backend.lowering.compile_worker import fake_inputs
from spmd_backend.lowering.handover import Settings, capture_settings, group_names, make_payload
from spmd_backend.lowering.inductor import (
    CacheMiss,
    InductorModule,
    cache_only,
    compile_flat,
    example_inputs,
    flat_for_inductor,
    lower_to_inductor,
    user_passes,
)

log = logging.getLogger(__name__)

_PACKAGE_ROOT = str(pathlib.Path(__file__).resolve().parents[2])
_LIVE: weakref.WeakSet[BackgroundLowered] = weakref.WeakSet()

COMPILING, COMPILED, FAILED = "compiling", "compiled", "failed"
#: what the worker process runs (``python -m``)
WORKER_MODULE = "spmd_backend.lowering.compile_worker"
#: on the second call, try the caches first: when every rank finds the compiled code there (a
#: warm start), all switch on that call and no worker starts (tests of the worker protocol
#: turn it off)
WARM_SWITCH = True


def _stop(proc: subprocess.Popen[bytes] | None, folder: str) -> None:
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()
    shutil.rmtree(folder, ignore_errors=True)


class BackgroundLowered(nn.Module):
    """The fx graph until the background compile is in and agreed; Inductor's code after."""

    def __init__(self, gm: fx.GraphModule, settings: Settings) -> None:
        super().__init__()
        self.source = gm
        self.graph = gm.graph
        self._settings = settings
        self._grad_enabled: bool = settings.process_state["grad_enabled"]
        # made on the second call (a graph called once never pays for them): the serialized
        # copy this process compiles at the switch (loaded then, from the bytes the worker
        # loads, so AOTAutograd's and Inductor's cache keys are the worker's), the input
        # descriptions, the output spec
        self._flat: bytes | None = None
        self._specs: list[Any] = []
        self._spec: Any = None
        self._payload = b""
        # set when another rank on this host compiles the same graph: its worker's status file
        self._shared_done: str | None = None
        # the ranks agree on the first group the graph's collectives name (None: no collectives)
        self._group_name: str | None = next(iter(group_names(gm)), None)
        self._folder = tempfile.mkdtemp(prefix="spmd_lowering_")
        self._proc: subprocess.Popen[bytes] | None = None
        self._launched = False  # the switch is open from here on (even if the launch failed)
        self._compiled: InductorModule | None = None
        self._agreement = SwitchAgreement(None, None)  # replaced on the second call
        self._local = COMPILING
        self._why = ""
        self.state = COMPILING
        self.calls = 0
        self.switched_at_call: int | None = None
        self._started = 0.0
        self._finalizer = weakref.finalize(self, _stop, None, self._folder)
        _LIVE.add(self)

    # ------------------------------------------------------------------ worker
    def _prepare(self) -> str | None:
        """The flat copy, its payload and key (None: it cannot be handed to a worker)."""
        try:
            flat, self._spec = flat_for_inductor(self.source)
            made = make_payload(flat, example_inputs(flat), self._settings)
        except Exception as e:  # noqa: BLE001 - decided with the other ranks: compiled now
            log.info("background compile: no payload (%s: %s)", type(e).__name__, e)
            return None
        if made is None:
            return None
        self._payload, self._flat, self._specs = made.data, made.graph, made.specs
        return made.key

    def _compile_copy(self) -> None:
        """Compile the serialized flat copy here, as the worker does: loaded now, on fresh fake
        tensors from the same descriptions, in :meth:`_compile_context` (so the cache keys are
        the worker's)."""
        assert self._flat is not None
        with self._compile_context():
            inputs = fake_inputs(self._specs)
            flat = serialize.load(self._flat)
            self._compiled = compile_flat(flat, self._spec, self.source, inputs)

    def _compile_cached(self) -> bool:
        """A warm start: compile the flat copy from AOTAutograd's and Inductor's caches alone
        (seconds); False, with nothing compiled, when they do not hold it."""
        if not WARM_SWITCH:
            return False
        try:
            with cache_only():
                self._compile_copy()
        except CacheMiss:
            return False
        except Exception as e:  # noqa: BLE001 - the worker path decides, as on a cold start
            log.info("background compile: loading from the caches failed (%s: %s)",
                     type(e).__name__, str(e)[:200])
            self._compiled = None
            return False
        return True

    def _start(self) -> None:
        self._launched = True
        key = self._prepare()
        self._agreement = SwitchAgreement(self._group_name, graph_identity(self.source))
        if key is not None and self._compile_cached():  # a warm start: ready, no worker needed
            self._local = COMPILED
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        mine = Entry(f"{socket.gethostname()}:{os.path.realpath(cache_dir())}", key,
                     os.path.join(self._folder, "graph.pkl.done"), self._local == COMPILED)
        election = self._agreement.elect(mine, self.calls)
        if key is None:  # this rank cannot hand the graph over: it compiles now
            log.info("background compile: the graph or its inputs cannot be handed to a worker; "
                     "compiling now")
            self._compile_here()
            return
        if election.everyone_cached:  # nobody loads a worker's result
            return
        leader = election.leader
        if leader is not None:
            if self._local != COMPILED:
                self._shared_done = leader  # no worker of its own
                self._started = time.perf_counter()  # the switch's log counts from here
                log.info("the step graph is compiled in the background by another rank on "
                         "this host (the same graph and cache); this rank loads its result")
            self._payload = b""
            return
        try:
            self._launch()
        except OSError as e:  # agreed with the other ranks like any failure
            self._local, self._why = FAILED, f"the compile worker could not start: {e}"

    @contextlib.contextmanager
    def _compile_context(self) -> Iterator[None]:
        """Where this process compiles during a call: the configuration and grad mode of where
        the graph was lowered (a Dynamo compile patches some), outside whatever tracing context
        (Dynamo's runtime wrapper) and fake mode the call is in."""
        configs = (pickle.loads(self._settings.inductor_config),  # noqa: S301
                   pickle.loads(self._settings.functorch_config))  # noqa: S301
        with torch._inductor.config.patch(configs[0]), \
                torch._functorch.config.patch(configs[1]), \
                torch._guards.tracing(None), \
                torch.set_grad_enabled(self._grad_enabled), \
                torch._subclasses.fake_tensor.unset_fake_temporarily():
            yield

    def _compile_here(self) -> None:
        """The blocking compile, in this process; this rank is then ready (or failed)."""
        with self._compile_context():
            module = lower_to_inductor(self.source)
        if isinstance(module, InductorModule):
            self._compiled, self._local = module, COMPILED
        else:
            self._local, self._why = FAILED, "Inductor could not compile it (see the log above)"

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
        if self._local != COMPILING:
            return
        if self._shared_done is not None:  # another rank's worker: its status file
            if not os.path.exists(self._shared_done):
                return
            if pathlib.Path(self._shared_done).read_text().strip() != "0":
                self._local, self._why = FAILED, "the compile worker of another rank failed"
                return
        elif self._proc is None or self._proc.poll() is None:
            return
        elif self._proc.returncode != 0:
            self._local, self._why = FAILED, f"the compile worker failed: {self._worker_error()}"
            return
        else:
            self._log.close()
        hits = torch._dynamo.utils.counters["inductor"]["fxgraph_cache_hit"]
        try:
            self._compile_copy()
        except Exception as e:  # noqa: BLE001 - stay on the fx graph, loudly
            self._local, self._why = FAILED, f"{type(e).__name__}: {str(e)[:300]}"
            return
        if torch._dynamo.utils.counters["inductor"]["fxgraph_cache_hit"] == hits:
            log.warning("background compile: its cache entry was not used; this process "
                        "compiled the graph again")
        self._local = COMPILED

    def _settle(self) -> None:
        """Post this rank's state once it is decided; switch (or give up) when the ranks that
        run this graph agree (see lowering.agreement)."""
        if self._local != COMPILING:
            self._agreement.post(READY if self._local == COMPILED else FAILED, self.calls)
        verdict = self._agreement.verdict(self.calls)
        if verdict == FAILED:
            self.state = FAILED
            why = self._why or "it failed on another rank"
            log.warning("Inductor could not compile the step graph in the background (%s); "
                        "running the fx graph instead", why)
            _stop(self._proc, self._folder)
            self._compiled = self._flat = None
        elif verdict == READY:
            self.state = COMPILED
            self.switched_at_call = self.calls
            if self._proc is None and self._shared_done is None:
                log.info("switched to Inductor's code at call %d: compiled without a worker "
                         "(the caches held it, or it could not be handed to one)", self.calls)
            else:
                log.info("switched to Inductor's code at call %d, %.1fs after the compile "
                         "started", self.calls, time.perf_counter() - self._started)
            _stop(None, self._folder)
            self._flat, self._payload = None, b""

    # ------------------------------------------------------------------ running
    def forward(self, *args: Any) -> Any:
        if self.state == COMPILED:
            return self._compiled(*args)  # type: ignore[misc]
        if self.state == COMPILING:
            if not self._launched:
                if self.calls >= 1:
                    self._start()
            else:
                self._advance_local()
            if self._launched:
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
    """Block until the workers this process started, or waits on, have finished (benchmarks and
    tests: the switch itself still happens on the next call, agreed by the ranks)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    for module in list(_LIVE):
        if module._proc is not None:
            module._proc.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        done = module._shared_done
        # another rank's worker: until its status file, or its folder is gone (that rank
        # stopped it), or the time is up
        while done is not None and not os.path.exists(done) and os.path.isdir(os.path.dirname(done)):
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("another rank's compile worker", timeout or 0.0)
            time.sleep(0.05)


def lower_in_background(gm: fx.GraphModule) -> nn.Module:
    """Lower ``gm`` with Inductor in a background process; see the module docstring."""
    if not torch._inductor.config.fx_graph_cache:
        log.info("background compile needs Inductor's FX graph cache; compiling now")
        return lower_to_inductor(gm)
    theirs = user_passes()
    if theirs:  # not in save_config(): a worker would compile without them
        log.info("background compile cannot hand torch._inductor.config's %s to a worker; "
                 "compiling now", ", ".join(theirs))
        return lower_to_inductor(gm)
    return BackgroundLowered(gm, capture_settings())


__all__ = [
    "WORKER_MODULE", "BackgroundLowered", "lower_in_background", "pending", "wait_for_background",
]
