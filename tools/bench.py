"""Benchmark suite: spmd_backend variants against DDP, measured side by side in one run.

    python tools/bench.py [--ranks 2] [--steps 20] [--workloads mlp gpt] [--variants ...]
    (workloads: mlp, gpt, hf_gpt2, bn_mlp)
                          [--out out/bench.json] [--md out/bench.md]

On N loopback ranks (gloo on CPU, NCCL when GPUs are present) and for each workload (the seed's
DummyModel MLP, dim 2048 x 5 layers, batch 32; a GPT-style transformer), every variant trains
with Adam, spelled as users write it (``--optim default``: single-tensor on CPU) and tuned
(``--optim fused``), each spelling on every side; steps are interleaved across variants so noise hits all alike. Per variant: median
steady-state step time (after warm-up), ratio to DDP eager, first-call (compile) time, optimizer state held per rank,
peak memory during its steps (process-wide RSS on CPU; on GPU the most its steps allocated
above what was allocated when they began) and exposed
communication (profiled time blocked in ``wait_tensor``). In the same run: the compute-only step
(one rank's local step without any communication) and the communication-only time (all_reduce of
the gradient bytes in DDP's 25 MB buckets); their max is the lower bound each variant is
compared with. Also: trace time of a 12-layer GPT's first calls and the pass-pipeline time on a
24-layer graph, and (``--compile-times``) the first call and the first two calls of each compiling variant in
fresh processes, cold (an empty Inductor cache) and warm (the cache the cold run filled), with
the time and calls until a background compile switches to Inductor's code, and
(``--memory``) each variant's peak memory per rank in its own processes (resident set on CPU,
the caching allocator's peak on GPU). Per variant, one
profiled step is split by category (compute, exposed communication, optimizer, packing and
copies, Python/runtime overhead; see ``CATEGORIES``).
Writes JSON and a markdown table. A benchmark, not a test.

Variants: ddp, ddp_compiled (torch.compile of the DDP model), spmd (no transformation),
spmd_opt (graph optimization), spmd_opt_inductor (graph optimization + Inductor), spmd_shard
(spmd_opt_inductor with ``DataParallel(shard_optimizer=True)``; spmd_shard_rs: the same with
``reduce_scatter_grads=True``, the reduce_scatter that gloo's default replaces by an all_reduce
and a slice; spmd_shard_buckets: spmd_shard_rs with its reduce_scatters and all_gathers bucketed,
which is not gloo's default), spmd_dynamo
(``torch.compile(step, backend="spmd")``: bucketing, wait scheduling, Inductor; spmd_dynamo_shard:
the same with ``options={"shard_optimizer": True}``), ddp_bf16 (DDP
with its ``bf16_compress_hook``) and spmd_bf16 (spmd_opt_inductor with
``DataParallel(gradient_compression="bf16")``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from spmd_backend.testing import run_on_ranks  # noqa: E402

ALL_VARIANTS = [
    "ddp", "ddp_compiled", "spmd", "spmd_opt", "spmd_opt_inductor", "spmd_shard", "spmd_dynamo",
    "ddp_bf16", "spmd_bf16", "spmd_shard_buckets", "spmd_dynamo_shard", "spmd_shard_rs",
]
#: how the optimizer is spelled on every side: as most users write it, or tuned
OPTIMIZERS = {"default": {}, "fused": {"fused": True}}


# ----------------------------------------------------------------------------- workloads
def _lm_step(model, optim, batch):
    import torch.nn.functional as F

    logits = model(batch)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _sum_step(model, optim, batch):
    loss = model(batch).sum()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def workload(name: str) -> tuple[Any, Any, Any]:
    from spmd_backend.testing.models import GPT, DummyModel

    if name == "mlp":
        return (lambda: DummyModel(5, 2048), lambda g: torch.randn(32, 2048, generator=g), _sum_step)
    if name == "gpt":
        return (
            lambda: GPT(vocab=512, dim=256, heads=4, layers=4, seq=64),
            lambda g: torch.randint(0, 512, (8, 64), generator=g),
            _lm_step,
        )
    if name == "hf_gpt2":  # transformers GPT-2, 4 layers x 256, 8 x 128 tokens
        return (_hf_gpt2, lambda g: torch.randint(0, 8192, (8, 128), generator=g), _hf_step)
    if name == "bn_mlp":  # 40 x (Linear 64, BatchNorm1d, Tanh): 120 buffers broadcast per step
        return (_bn_mlp, lambda g: torch.randn(32, 64, generator=g), _sum_step)
    raise SystemExit(f"unknown workload {name!r}")


def _bn_mlp() -> torch.nn.Module:
    import torch.nn as nn

    blocks = [nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.Tanh()) for _ in range(40)]
    return nn.Sequential(*blocks, nn.Linear(64, 1))


def _hf_gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=8192, n_positions=128,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                        eos_token_id=0)
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"
    return model


def _hf_step(model, optim, batch):
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


# ----------------------------------------------------------------------------- measurement
class RssSampler:
    """Samples this process's resident set size every few milliseconds."""

    def __init__(self, period: float = 0.005) -> None:
        self.period = period
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter(), self.rss()))
            time.sleep(self.period)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def peak(self, windows: list[tuple[float, float]]) -> int:
        return max((r for t, r in self.samples if any(a <= t <= b for a, b in windows)), default=0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _build(variant: str, build, step_fn, device, optim: str = "fused"):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import spmd_backend
    from spmd_backend.gm_transformation import GraphModuleTransformation

    torch.manual_seed(0)
    model = build().to(device)
    ids = [device.index] if device.type == "cuda" else None
    if variant in ("ddp", "ddp_compiled", "compute_only", "ddp_bf16"):
        net = DDP(model, device_ids=ids) if variant != "compute_only" else model
        if variant == "ddp_bf16":
            from spmd_backend.testing.parity import register_compression_hook

            register_compression_hook(net, "bf16")
        opt = torch.optim.Adam(net.parameters(), lr=1e-4, **OPTIMIZERS[optim])
        fwd = torch.compile(net) if variant == "ddp_compiled" else net
        return (lambda b: step_fn(fwd, opt, b)), net, opt
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, **OPTIMIZERS[optim])
    if variant in ("spmd_dynamo", "spmd_dynamo_shard"):
        options = {"shard_optimizer": True} if variant == "spmd_dynamo_shard" else None
        compiled = torch.compile(step_fn, backend="spmd", options=options)
        return (lambda b: compiled(model, opt, b)), model, opt
    transformation = None
    if variant != "spmd":
        transformation = GraphModuleTransformation(
            enable_graph_optimization=True,
            enable_inductor=variant in ("spmd_opt_inductor", "spmd_shard", "spmd_bf16",
                                        "spmd_shard_buckets", "spmd_shard_rs"),
        )
    if variant == "spmd_shard_buckets":
        import dataclasses

        from spmd_backend.passes import comm_fusion_with_concat, default_pipeline

        transformation.config = dataclasses.replace(transformation.config, passes=(
            (comm_fusion_with_concat, {"shard_buckets": True}), *default_pipeline(25)[1:]))
    step = spmd_backend.compile(
        gm_transformation=transformation,
        parallel_mode=spmd_backend.DataParallel(
            reduce_op="avg",
            shard_optimizer=variant in ("spmd_shard", "spmd_shard_buckets", "spmd_shard_rs"),
            reduce_scatter_grads=True if variant in ("spmd_shard_buckets", "spmd_shard_rs") else None,
            gradient_compression="bf16" if variant == "spmd_bf16" else None,
        ),
    )(step_fn)
    run = lambda b: step(model, opt, b)  # noqa: E731
    if transformation is not None and transformation.config.inductor:
        run.fell_back = lambda: not _lowered(step)  # type: ignore[attr-defined]
    return run, model, opt


def _lowered(step: Any) -> bool:
    """Whether the compile door's steady-state step graph runs Inductor's code (a lowering
    that failed logs it and runs the fx graph: the bench must not call that Inductor)."""
    from spmd_backend.lowering import InductorModule

    compiled = getattr(step, "compiled", None)
    gm = compiled._gm("main") if compiled is not None and hasattr(compiled, "_gm") else compiled
    return isinstance(gm, InductorModule)


def _state_mb(opt: torch.optim.Optimizer) -> float:
    """Optimizer state held by this rank."""
    return sum(
        v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
        if isinstance(v, torch.Tensor)
    ) / 2**20


def _comm_only(model: torch.nn.Module, device: torch.device, reps: int = 5) -> float:
    """Median time of all_reducing the model's gradient bytes in DDP's 25 MB buckets."""
    import torch.distributed as dist

    numel = sum(p.numel() for p in model.parameters())
    cap = 25 * 1024 * 1024 // 4
    chunks = [torch.zeros(min(cap, numel - i), device=device) for i in range(0, numel, cap)]
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        works = [dist.all_reduce(c, async_op=True) for c in chunks]
        for w in works:
            w.wait()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


#: profiler event name fragments per category, first match wins (a fused Inductor kernel is
#: named after the ops it fuses: "cpp_fused_cat_sum_threshold_backward" counts as packing)
CATEGORIES = (
    ("comm", ("wait_tensor", "allreduce", "all_reduce", "reduce_scatter", "all_gather",
              "allgather", "broadcast")),
    ("optimizer", ("fused_adam", "optimizer.step", "_foreach_", "lerp", "sqrt", "adam")),
    ("packing", ("cat", "split", "copy", "aten::mul", "div_", "_to_copy")),
    ("overhead", ("call compiledfxgraph", "aotdispatcher", "runtime wrapper")),
)


def _category(name: str) -> str:
    low = name.lower()
    for category, fragments in CATEGORIES:
        if any(f in low for f in fragments):
            return category
    return "compute"


def _breakdown(run, batch, device) -> dict[str, float]:
    """Self CPU seconds of one profiled step by category (CATEGORIES; the rest is compute).
    comm is the time the step spent in collectives and waiting for them: exposed, not total."""
    from torch.profiler import profile

    with profile() as prof:
        run(batch)
        _sync(device)
    out = {c: 0.0 for c in ("compute", "comm", "optimizer", "packing", "overhead")}
    for e in prof.key_averages():
        out[_category(e.key)] += e.self_cpu_time_total / 1e6
    return out


def _bench_job(
    rank: int, world: int, names: list[str], variants: list[str], steps: int, optim: str
) -> dict:
    import torch.distributed as dist

    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    if not use_cuda:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
        import torch._inductor.config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True  # one profiler event per kernel
    # the steady steps measure Inductor's code: compile before the first step (the background
    # compile switches to the same code later; its timings are --compile-times')
    os.environ["SPMD_BACKEND_BACKGROUND_COMPILE"] = "0"
    out: dict[str, Any] = {}
    for name in names:
        build, make_batch, step_fn = workload(name)
        runs: dict[str, Any] = {}
        first: dict[str, float] = {}
        opts: dict[str, Any] = {}
        gen = torch.Generator().manual_seed(rank)
        batches = [make_batch(gen).to(device) for _ in range(steps + 4)]
        for v in [*variants, "compute_only"]:
            run, model, opts[v] = _build(v, build, step_fn, device, optim)
            dist.barrier()
            t0 = time.perf_counter()
            run(batches[0])  # a fresh optimizer: spmd's bootstrap graph
            run(batches[1])  # spmd's steady-state trace, passes and lowering
            _sync(device)
            first[v] = time.perf_counter() - t0
            runs[v] = run
        times: dict[str, list[float]] = {v: [] for v in runs}
        windows: dict[str, list[tuple[float, float]]] = {v: [] for v in runs}
        # on CUDA: the most its own steps allocated above what was allocated when they started
        # (every variant's model lives in this process; --memory measures each one alone)
        cuda_peak: dict[str, int] = dict.fromkeys(runs, 0)
        with RssSampler() as sampler:
            for i, batch in enumerate(batches[2:]):
                for v, run in runs.items():
                    if v != "compute_only":
                        dist.barrier()
                    if use_cuda:
                        torch.cuda.reset_peak_memory_stats()
                        before = torch.cuda.memory_allocated()
                    t0 = time.perf_counter()
                    run(batch)
                    _sync(device)
                    t1 = time.perf_counter()
                    if i >= 2:
                        times[v].append(t1 - t0)
                        windows[v].append((t0, t1))
                        if use_cuda:
                            cuda_peak[v] = max(cuda_peak[v],
                                               torch.cuda.max_memory_allocated() - before)
        comm = _comm_only(model, device)
        compute = statistics.median(times["compute_only"])
        bound = max(compute, comm)
        res: dict[str, Any] = {"compute_only_ms": 1e3 * compute, "comm_only_ms": 1e3 * comm,
                               "lower_bound_ms": 1e3 * bound, "variants": {}}
        ddp_med = statistics.median(times["ddp"]) if "ddp" in times else None
        for v in variants:
            med = statistics.median(times[v])
            parts = _breakdown(runs[v], batches[1], device)
            exposed = parts["comm"]
            res["variants"][v] = {
                "fell_back_to_fx_graph": bool(getattr(runs[v], "fell_back", lambda: False)()),
                "step_ms": 1e3 * med,
                "ratio_to_ddp": med / ddp_med if ddp_med else None,
                "first_call_s": first[v],
                "peak_mem_mb": (cuda_peak[v] if use_cuda else sampler.peak(windows[v])) / 2**20,
                "exposed_comm_ms": 1e3 * exposed if exposed is not None else None,
                "distance_to_bound": med / bound,
                "optim_state_mb": _state_mb(opts[v]),
                "breakdown_ms": {k: 1e3 * t for k, t in parts.items()},
            }
        out[name] = res
        del runs
    return out


def _trace_job(rank: int, world: int, layers: int) -> dict:
    import spmd_backend
    from spmd_backend.gm_transformation import GraphModuleTransformation
    from spmd_backend.testing.models import GPT

    torch.manual_seed(0)
    model = GPT(vocab=512, dim=256, heads=4, layers=layers, seq=64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    transformation = GraphModuleTransformation(enable_graph_optimization=True)
    step = spmd_backend.compile(gm_transformation=transformation)(_lm_step)
    batch = torch.randint(0, 512, (4, 64))
    t0 = time.perf_counter()
    step(model, opt, batch)
    first_call = time.perf_counter() - t0
    first_trace = step.graph.traced.trace_seconds
    t0 = time.perf_counter()
    step(model, opt, batch)
    second_call = time.perf_counter() - t0
    passes = sum(r.seconds for r in transformation.pass_records)
    return {
        "layers": layers,
        "nodes": len(step.graph.traced.gm.graph.nodes),
        "first_call_s": first_call,
        "first_trace_s": first_trace,
        "second_call_s": second_call,
        "second_trace_s": step.graph.traced.trace_seconds,
        "pass_pipeline_s": passes,
        "passes": {r.name: r.seconds for r in transformation.pass_records},
    }


def _first_calls_job(rank: int, world: int, name: str, variant: str, optim: str,
                     max_calls: int = 400) -> dict[str, float]:
    """A fresh process's first two calls (compile, state creation, recompile), in seconds, and,
    for a background compile, the seconds and calls until Inductor's code runs (the calls in
    between run the fx graph)."""
    import torch.distributed as dist

    from spmd_backend.lowering import pending

    build, make_batch, step_fn = workload(name)
    gen = torch.Generator().manual_seed(rank)
    batches = [make_batch(gen) for _ in range(2)]
    run, _, _ = _build(variant, build, step_fn, torch.device("cpu"), optim)
    dist.barrier()
    from torch._dynamo.utils import counters

    t0 = time.perf_counter()
    run(batches[0])
    call1 = time.perf_counter() - t0
    hits = counters["aot_autograd"]["autograd_cache_hit"]  # graphs served by AOTAutograd's cache
    run(batches[1])
    first = time.perf_counter() - t0
    calls = 2
    while calls < max_calls:
        if calls == 2:  # the compile door's step graph first runs on call 2: its worker starts on 3
            run(batches[0])
            calls += 1
        # pending() is the same on every rank after each call; checked, so a bug cannot hang here
        flags = torch.tensor([int(pending() > 0), 1])
        dist.all_reduce(flags)
        if 0 < flags[0] < flags[1]:
            raise RuntimeError(f"rank {rank}: ranks disagree on pending background compiles")
        if not flags[0]:
            break
        run(batches[calls % 2])
        calls += 1
    return {"call1_s": call1, "first_s": first, "compiled_s": time.perf_counter() - t0,
            "calls": calls, "call1_cache_hits": hits}


def _memory_job(rank: int, world: int, name: str, variant: str, optim: str, steps: int) -> dict:
    """Resident memory of one variant alone in a fresh process: the peak during steady steps
    (after the two calls that compile) and the process's lifetime peak (compilation included)."""
    import resource

    import torch.distributed as dist

    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    os.environ["SPMD_BACKEND_BACKGROUND_COMPILE"] = "0"  # steady steps run Inductor's code
    build, make_batch, step_fn = workload(name)
    gen = torch.Generator().manual_seed(rank)
    batches = [make_batch(gen).to(device) for _ in range(steps + 2)]
    run, _, _ = _build(variant, build, step_fn, device, optim)
    for b in batches[:2]:
        run(b)
    dist.barrier()
    if use_cuda:  # GPU memory: the caching allocator's peak of live tensors
        _sync(device)
        lifetime = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        for b in batches[2:]:
            run(b)
        _sync(device)
        steady = torch.cuda.max_memory_allocated()
        return {"steady_peak_mb": steady / 2**20, "lifetime_peak_mb": max(lifetime, steady) / 2**20}
    with RssSampler(period=0.002) as sampler:
        t0 = time.perf_counter()
        for b in batches[2:]:
            run(b)
        t1 = time.perf_counter()
    return {"steady_peak_mb": sampler.peak([(t0, t1)]) / 2**20,
            "lifetime_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _per_variant(names: list[str], optims: list[str], variants: list[str],
                 measure: Callable[[str, str, str], dict[str, float]]) -> dict[str, Any]:
    """``{"<name>, Adam <optim>": {variant: measure(name, variant, optim)}}``."""
    return {
        f"{name}, Adam {optim}": {v: measure(name, v, optim) for v in variants}
        for name in names for optim in optims
    }


def memory(names: list[str], variants: list[str], ranks: int, optims: list[str],
           steps: int = 5) -> dict[str, Any]:
    """Peak resident memory per rank, each variant in its own processes (the larger rank)."""

    def measure(name: str, v: str, optim: str) -> dict[str, float]:
        per_rank = run_on_ranks(_memory_job, name, v, optim, steps, world_size=ranks,
                                timeout=1800, backend=_backend())
        return {k: max(r[k] for r in per_rank) for k in per_rank[0]}

    return _per_variant(names, optims, variants, measure)


def compile_times(names: list[str], variants: list[str], ranks: int,
                  optims: list[str]) -> dict[str, Any]:
    """First two calls per variant in fresh processes, cold (empty Inductor cache) then warm,
    and the time until Inductor's code runs (background compiles)."""
    import tempfile

    def measure(name: str, v: str, optim: str) -> dict[str, float]:
        env = {"TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="bench_inductor_")}
        cold, warm = (run_on_ranks(_first_calls_job, name, v, optim, world_size=ranks, env=env,
                                   timeout=1800) for _ in range(2))
        out = {f"{k}_{kind}": max(r[k] for r in runs) for kind, runs in (("cold", cold), ("warm", warm))
               for k in ("call1_s", "first_s", "compiled_s", "calls")}
        out["call1_cache_hits_warm"] = min(r["call1_cache_hits"] for r in warm)  # every rank's
        return out

    return _per_variant(names, optims, variants, measure)


def _backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _fmt(x: Any, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def markdown(result: dict) -> str:
    lines = [f"machine: {result['meta']['machine']}, torch {result['meta']['torch']}, "
             f"{result['meta']['ranks']} ranks ({result['meta']['backend']}), "
             f"{result['meta']['steps']} measured steps\n"]
    for key, res in result["workloads"].items():
        name = key
        lines.append(f"### {name}: compute-only {res['compute_only_ms']:.1f} ms, comm-only "
                     f"{res['comm_only_ms']:.1f} ms, lower bound {res['lower_bound_ms']:.1f} ms\n")
        lines.append("| variant | step ms | vs DDP eager | vs lower bound | first 2 calls s | peak mem MB | optimizer state MB | exposed comm ms |")
        lines.append("|---|---|---|---|---|---|---|---|")
        fell_back = [v for v, r in res["variants"].items() if r.get("fell_back_to_fx_graph")]
        for v, r in res["variants"].items():
            mark = " (fx graph: Inductor failed)" if v in fell_back else ""
            lines.append(
                f"| {v}{mark} | {r['step_ms']:.1f} | {_fmt(r['ratio_to_ddp'], '.2f')}x | "
                f"{r['distance_to_bound']:.2f}x | {r['first_call_s']:.1f} | {r['peak_mem_mb']:.0f} | "
                f"{_fmt(r.get('optim_state_mb'), '.0f')} | {_fmt(r['exposed_comm_ms'])} |"
            )
        lines.append("")
        lines.append("Where the time goes (one profiled step, self CPU ms by category):\n")
        lines.append("| variant | compute | exposed comm | optimizer | packing/copies | overhead |")
        lines.append("|---|---|---|---|---|---|")
        for v, r in res["variants"].items():
            b = r.get("breakdown_ms") or {}
            lines.append(f"| {v} | " + " | ".join(
                _fmt(b.get(k)) for k in ("compute", "comm", "optimizer", "packing", "overhead")
            ) + " |")
        lines.append("")
    for name, per_variant in result.get("compile_times", {}).items():
        lines.append(f"### {name}: first calls in a fresh process, s\n")
        lines.append("| variant | cold: first call | cold: first 2 calls | cold: until compiled "
                     "code (calls) | warm: first call | warm: first 2 calls | warm: until "
                     "compiled code (calls) | warm: AOTAutograd cache hits in call 1 |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for v, t in per_variant.items():
            lines.append(f"| {v} | {t['call1_s_cold']:.1f} | {t['first_s_cold']:.1f} | "
                         f"{t['compiled_s_cold']:.1f} ({t['calls_cold']}) | "
                         f"{t['call1_s_warm']:.1f} | {t['first_s_warm']:.1f} | "
                         f"{t['compiled_s_warm']:.1f} ({t['calls_warm']}) | "
                         f"{t.get('call1_cache_hits_warm', '-')} |")
        lines.append("")
    for name, per_variant in result.get("memory", {}).items():
        what = "peak allocated GPU" if result["meta"]["backend"] == "nccl" else "resident"
        lines.append(f"### {name}: {what} memory per rank, each variant in its own processes, MB\n")
        lines.append("| variant | steady steps peak | vs ddp | lifetime peak (compile included) |")
        lines.append("|---|---|---|---|")
        base = per_variant.get("ddp", {}).get("steady_peak_mb")
        for v, m in per_variant.items():
            ratio = m["steady_peak_mb"] / base if base else None
            lines.append(f"| {v} | {m['steady_peak_mb']:.0f} | {_fmt(ratio, '.2f')}x | "
                         f"{m['lifetime_peak_mb']:.0f} |")
        lines.append("")
    for key in ("trace12", "trace24"):
        t = result.get(key)
        if t:
            lines.append(
                f"Trace, GPT {t['layers']} layers ({t['nodes']} nodes): first call {t['first_call_s']:.2f} s "
                f"(trace {t['first_trace_s']:.2f} s), second call {t['second_call_s']:.2f} s "
                f"(trace {t['second_trace_s']:.2f} s), pass pipeline {t['pass_pipeline_s']:.2f} s\n"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--workloads", nargs="+", default=["mlp", "gpt"])
    parser.add_argument("--variants", nargs="+", default=ALL_VARIANTS)
    parser.add_argument("--optim", nargs="+", default=["default", "fused"], choices=list(OPTIMIZERS),
                        help="Adam as users write it (default) and/or Adam(fused=True), every side")
    parser.add_argument("--no-trace", action="store_true")
    parser.add_argument("--no-steps", action="store_true", help="skip the step-time table")
    parser.add_argument("--compile-times", nargs="*", default=None,
                        help="variants whose first calls to time in fresh processes")
    parser.add_argument("--memory", nargs="*", default=None,
                        help="variants whose resident memory to measure, each in its own processes")
    parser.add_argument("--out", default="out/bench.json")
    parser.add_argument("--md", default="out/bench.md")
    args = parser.parse_args()
    backend = _backend()
    result: dict[str, Any] = {
        "meta": {
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
            "torch": torch.__version__, "ranks": args.ranks, "backend": backend, "steps": args.steps,
            "date": time.strftime("%Y-%m-%d"),
        }
    }
    result["workloads"] = {}
    for optim in [] if args.no_steps else args.optim:
        per = run_on_ranks(
            _bench_job, args.workloads, args.variants, args.steps, optim,
            world_size=args.ranks, timeout=3600, backend=backend,
        )[0]
        result["workloads"].update({f"{name}, Adam {optim}": r for name, r in per.items()})
    if args.compile_times is not None:
        variants = args.compile_times or ["ddp_compiled", "spmd_dynamo", "spmd_opt_inductor"]
        result["compile_times"] = compile_times(args.workloads, variants, args.ranks, args.optim)
    if args.memory is not None:
        variants = args.memory or ["ddp", "spmd_opt_inductor", "spmd_shard"]
        result["memory"] = memory(args.workloads, variants, args.ranks, args.optim)
    if not args.no_trace:
        result["trace12"] = run_on_ranks(_trace_job, 12, world_size=args.ranks, timeout=1800)[0]
        result["trace24"] = run_on_ranks(_trace_job, 24, world_size=args.ranks, timeout=1800)[0]
    for path in (args.out, args.md):
        pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(result, indent=2))
    md = markdown(result)
    pathlib.Path(args.md).write_text(md)
    print(md)
    print(f"wrote {args.out} and {args.md}")


if __name__ == "__main__":
    main()
