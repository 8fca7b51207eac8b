"""Compare a compiled train step with DDP, inside a multi-rank job.

:func:`check_ddp_parity` is meant to run on every rank (``RankPool.run(check_ddp_parity,
case)``): it builds a registered model twice from the same seed, wraps one copy in DDP, trains
both for ``case.steps`` steps on rank-dependent batches (so that skipping the gradient
collectives changes the result), and asserts that parameters, buffers and optimizer state match
under ``torch.testing.assert_close``'s fp32 tolerances. With the default SUM reduction the DDP
side multiplies its averaged gradients by ``world_size`` before stepping, as the upstream seed
test does. Both sides of a step draw from the same state of torch's generator, so a model with
dropout compares mask for mask, and the compiled step must leave the generator where DDP's step
leaves it (Inductor's own random numbers, which the Dynamo door's Inductor lowering draws, fail
this: compare such models with ``dynamo_options={"inductor": False}``). ``ParityCase(dynamo_options={...})`` checks the Dynamo door
(``torch.compile(step, backend="spmd")``) instead and reports what the backend received.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import spmd_backend
from spmd_backend.parallel.data_parallel import DataParallel
from spmd_backend.testing.models import MODELS, ModelEntry


@dataclass(frozen=True)
class OptimSpec:
    """A picklable description of an optimizer (and optional LR schedule)."""

    kind: str = "adam"  # sgd | adam | adamw
    impl: str = "foreach"  # foreach | fused | single | default (what torch picks)
    lr: float = 0.01
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    capturable: bool = False
    param_groups: int = 1
    scheduler: bool = False

    def label(self) -> str:
        bits = [self.kind, self.impl]
        if self.momentum:
            bits.append(f"m{self.momentum}")
        if self.nesterov:
            bits.append("nesterov")
        if self.weight_decay:
            bits.append(f"wd{self.weight_decay}")
        if self.capturable:
            bits.append("capturable")
        if self.param_groups > 1:
            bits.append(f"{self.param_groups}groups")
        if self.scheduler:
            bits.append("sched")
        return "-".join(bits)

    def build(
        self, model: nn.Module, *, reference: bool = False
    ) -> tuple[torch.optim.Optimizer, Any]:
        """The optimizer (and scheduler or None). ``reference`` builds the eager/DDP twin,
        which drops ``capturable`` where eager cannot run it (CPU, non-fused)."""
        params = [p for p in model.parameters() if p.requires_grad]
        if self.param_groups > 1:
            half = max(1, len(params) // 2)
            groups: list[dict[str, Any]] = [
                {"params": params[:half]},
                {"params": params[half:], "lr": self.lr * 0.5, "weight_decay": self.weight_decay * 2},
            ]
        else:
            groups = [{"params": params}]
        kwargs: dict[str, Any] = {"lr": self.lr, "weight_decay": self.weight_decay}
        if self.impl == "fused":
            kwargs["fused"] = True
        elif self.impl != "default":
            kwargs["foreach"] = self.impl == "foreach"
        if self.kind == "sgd":
            kwargs.update(momentum=self.momentum, nesterov=self.nesterov)
            opt: torch.optim.Optimizer = torch.optim.SGD(groups, **kwargs)
        else:
            capturable = self.capturable
            on_cpu = all(p.device.type == "cpu" for p in params)
            if reference and on_cpu and self.impl != "fused":
                capturable = False
            kwargs["capturable"] = capturable
            cls = torch.optim.Adam if self.kind == "adam" else torch.optim.AdamW
            opt = cls(groups, **kwargs)
        sched = None
        if self.scheduler:
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.3 * s))
        return opt, sched


@dataclass(frozen=True)
class ParityCase:
    """One parity experiment: model x optimizer x reduction x optional transformation."""

    model: Any  # a registered model name, or an object with the ModelEntry interface
    optim: OptimSpec = field(default_factory=OptimSpec)
    steps: int = 10
    reduce_op: str = "sum"
    transformation: Callable[[Any], Any] | None = None
    seed: int = 0
    #: None: ``spmd_backend.compile``; a dict: ``torch.compile(step, backend="spmd", options=...)``
    #: (``reduce_op`` is added to it)
    dynamo_options: dict[str, Any] | None = None
    #: ``DataParallel(shard_optimizer=True)``; the optimizer state is compared through
    #: ``state_dict()`` (full on every rank)
    shard_optimizer: bool = False
    #: ``"bf16"``/``"fp16"``: ``DataParallel(gradient_compression=...)`` against DDP with the
    #: same compression hook registered
    gradient_compression: str | None = None
    #: ``DataParallel(reduce_scatter_grads=...)`` (with ``shard_optimizer``; None: by backend,
    #: which on gloo all-reduces and slices)
    reduce_scatter_grads: bool | None = None
    #: the step calls ``optim.zero_grad()`` first, as most training loops do, instead of last:
    #: the gradients then outlive the step and are compared with DDP's too
    zero_grad_first: bool = False

    def label(self) -> str:
        t = getattr(self.transformation, "__name__", None) or (
            type(self.transformation).__name__ if self.transformation is not None else None
        )
        model = self.model if isinstance(self.model, str) else getattr(
            self.model, "describe", lambda: type(self.model).__name__
        )()
        door = "/dynamo" if self.dynamo_options is not None else ""
        door += "/sharded" if self.shard_optimizer else ""
        door += f"/{self.gradient_compression}" if self.gradient_compression else ""
        door += {True: "/reduce_scatter", False: "/all_reduce", None: ""}[self.reduce_scatter_grads]
        door += "/zero_grad_first" if self.zero_grad_first else ""
        return f"{model}/{self.optim.label()}/{self.reduce_op}{door}" + (f"/{t}" if t else "")


@dataclass
class ParityResult:
    """What one rank measured: largest differences and the loss trajectory."""

    label: str
    max_param_diff: float
    max_state_diff: float
    losses: list[float]
    traces: int
    #: Dynamo door: graphs the backend received (whole-step, per-graph) and graph breaks
    dynamo: dict[str, int] = field(default_factory=dict)


def _compare(a: torch.Tensor, b: torch.Tensor, what: str) -> float:
    torch.testing.assert_close(a, b, msg=lambda m: f"{what}: {m}")
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def make_train_step(entry: ModelEntry, zero_grad_first: bool = False) -> Callable[..., torch.Tensor]:
    """The canonical eager step: loss, backward, optimizer step, zero_grad (or zero_grad
    first); returns the loss (as the README writes it: not detached)."""

    def train_step(model: nn.Module, optim: torch.optim.Optimizer, batch: torch.Tensor) -> torch.Tensor:
        loss = entry.loss(model, batch)
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    def zero_first_step(model: nn.Module, optim: torch.optim.Optimizer, batch: torch.Tensor) -> torch.Tensor:
        optim.zero_grad()
        loss = entry.loss(model, batch)
        loss.backward()
        optim.step()
        return loss

    return zero_first_step if zero_grad_first else train_step


def register_compression_hook(ddp: DDP, kind: str) -> None:
    """Register DDP's own ``bf16_compress_hook``/``fp16_compress_hook`` (``kind``: ``"bf16"`` or
    ``"fp16"``) on ``ddp``, through a wrapper: DDP refuses the bf16 hook by name unless NCCL is
    in use, though gloo reduces bfloat16 fine."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch_hook = {"bf16": default_hooks.bf16_compress_hook,
                  "fp16": default_hooks.fp16_compress_hook}[kind]

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
        return torch_hook(state, bucket)

    ddp.register_comm_hook(None, hook)


def check_ddp_parity(rank: int, world_size: int, case: ParityCase) -> ParityResult:
    """Train a compiled step and DDP side by side; assert they agree (run on every rank)."""
    entry = MODELS[case.model] if isinstance(case.model, str) else case.model
    torch.manual_seed(case.seed)
    model = entry.build()
    ref_model = copy.deepcopy(model)
    ddp = DDP(ref_model, find_unused_parameters=entry.find_unused_parameters)
    if case.gradient_compression is not None:
        register_compression_hook(ddp, case.gradient_compression)
    opt, sched = case.optim.build(model)
    ref_opt, ref_sched = case.optim.build(ref_model, reference=True)

    step = _compiled_step(case, make_train_step(entry, case.zero_grad_first))

    gen = torch.Generator().manual_seed(1000 + rank)
    losses: list[float] = []
    for _ in range(case.steps):
        batch = entry.batch(gen)
        drawn_from = torch.get_rng_state()
        loss = step(model, opt, batch)
        losses.append(float(loss))
        compiled_left = torch.get_rng_state()
        torch.set_rng_state(drawn_from)  # DDP's step draws from where the compiled one did
        if case.zero_grad_first:
            ref_opt.zero_grad()
        ref_loss = entry.loss(ddp, batch)
        ref_loss.backward()
        if not torch.equal(compiled_left, torch.get_rng_state()):
            raise AssertionError(
                f"{case.label()} step {len(losses)}: the compiled step left torch's generator "
                "elsewhere than DDP's step (it drew other random numbers, or as many again)")
        if case.reduce_op == "sum":
            with torch.no_grad():
                for p in ref_model.parameters():
                    if p.grad is not None:
                        p.grad *= world_size
        ref_opt.step()
        if not case.zero_grad_first:
            ref_opt.zero_grad()
        if sched is not None:
            sched.step()
            ref_sched.step()

    max_p = 0.0
    for (name, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        a, b = p.detach(), q.detach()
        zero_gradient = getattr(entry, "zero_gradient", None)
        noise = zero_gradient(name, p) if zero_gradient is not None else None
        if noise is not None:  # a mathematically zero gradient: Adam steps on rounding noise
            bound = 2.0 * case.optim.lr * case.steps
            assert float((a[noise] - b[noise]).abs().max()) <= bound, f"{name}[{noise}]"
            a, b = a.clone(), b.clone()
            a[noise] = 0.0
            b[noise] = 0.0
        max_p = max(max_p, _compare(a, b, f"{case.label()} parameter {name}"))
        if (p.grad is None) != (q.grad is None):
            raise AssertionError(f"{case.label()}: .grad of {name} is {p.grad} vs DDP {q.grad}")
        if p.grad is not None and noise is None:
            _compare(p.grad, q.grad, f"{case.label()} .grad of {name}")
    for (name, b), (_, c) in zip(model.named_buffers(), ref_model.named_buffers()):
        _compare(b, c, f"{case.label()} buffer {name}")
    max_s = 0.0
    sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    if set(sd["state"]) != set(ref_sd["state"]):
        raise AssertionError(
            f"{case.label()}: optimizer state for params {sorted(sd['state'])} vs DDP "
            f"{sorted(ref_sd['state'])}"
        )
    for idx, st in sd["state"].items():
        for k, v in st.items():
            rv = ref_sd["state"][idx][k]
            if isinstance(v, torch.Tensor):
                max_s = max(max_s, _compare(v.to(rv.device), rv, f"{case.label()} state[{idx}][{k}]"))
            elif v != rv:
                raise AssertionError(f"{case.label()}: state[{idx}][{k}] {v} vs DDP {rv}")
    for g, rg in zip(sd["param_groups"], ref_sd["param_groups"]):
        if g["lr"] != rg["lr"]:
            raise AssertionError(f"{case.label()}: lr {g['lr']} vs DDP {rg['lr']}")
    return ParityResult(
        label=case.label(), max_param_diff=max_p, max_state_diff=max_s, losses=losses,
        traces=getattr(step, "trace_count", 0), dynamo=_dynamo_counts(case),
    )


def _compiled_step(case: ParityCase, train_step: Callable[..., Any]) -> Callable[..., Any]:
    if case.dynamo_options is None:
        return spmd_backend.compile(
            gm_transformation=case.transformation,
            parallel_mode=DataParallel(
                reduce_op=case.reduce_op, shard_optimizer=case.shard_optimizer,
                gradient_compression=case.gradient_compression,
                reduce_scatter_grads=case.reduce_scatter_grads,
            ),
        )(train_step)
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    options = {**case.dynamo_options, "reduce_op": case.reduce_op}
    if case.gradient_compression is not None:
        options["gradient_compression"] = case.gradient_compression
    if case.reduce_scatter_grads is not None:
        options["reduce_scatter_grads"] = case.reduce_scatter_grads
    return torch.compile(train_step, backend="spmd", options=options)


def _dynamo_counts(case: ParityCase) -> dict[str, int]:
    if case.dynamo_options is None:
        return {}
    from torch._dynamo.utils import counters

    return {
        "whole_step_graphs": counters["spmd"]["whole_step_graphs"],
        "per_graph_graphs": counters["spmd"]["per_graph_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
        "unique_graphs": counters["stats"]["unique_graphs"],
        "cache_hits": counters["spmd"]["step_cache_hits"],
        "cache_saved": counters["spmd"]["step_cache_saved"],
    }


def without_gradient_collectives(gm: Any) -> Any:
    """Negative control for parity tests: a transformation that routes every gradient
    ``wait_tensor`` around its all_reduce (no communication), so parity must fail."""
    from spmd_backend.graph import ops

    for node in list(gm.graph.nodes):
        if ops.is_wait(node) and ops.is_all_reduce(node.args[0]):
            node.replace_all_uses_with(node.args[0].args[0])
    gm.graph.eliminate_dead_code(
        is_impure_node=lambda n: ops.is_copy_(n) or n.op in ("placeholder", "output")
    )
    gm.recompile()
    if any(ops.is_all_reduce(n) for n in gm.graph.nodes):
        raise AssertionError("without_gradient_collectives left an all_reduce in the graph")
    return gm
