"""Gradient accumulation against DDP with ``no_sync`` (2 gloo ranks, both reduce ops).

Three ways users accumulate: across calls (forward/backward calls, then a call that steps),
several backward calls inside one step, and ``zero_grad(set_to_none=False)`` (every call starts
from an existing, zeroed ``.grad``). Each must match DDP: under ``sum`` the compiled gradients
are ``world_size`` x DDP's, never more (an earlier, already reduced, micro-batch must not be
reduced again).
"""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = pytest.mark.multirank


def _job(rank: int, world: int, reduce_op: str) -> dict[str, float]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import spmd_backend
    from spmd_backend.graph import ops
    from spmd_backend.testing.models import MLP

    torch.manual_seed(0)
    base = MLP(8, 16, 2, 4)
    mode = spmd_backend.DataParallel(reduce_op=reduce_op)
    gen = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randn(4, 8, generator=gen) for _ in range(6)]

    def loss_of(model, x):
        return model(x).pow(2).mean()

    def ddp_reference() -> tuple[torch.nn.Module, torch.optim.Optimizer, DDP]:
        model = copy.deepcopy(base)
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), DDP(model)

    def ddp_accumulate(ddp: DDP, opt: torch.optim.Optimizer, xs: list[torch.Tensor]) -> None:
        with ddp.no_sync():
            for x in xs[:-1]:
                loss_of(ddp, x).backward()
        loss_of(ddp, xs[-1]).backward()
        if reduce_op == "sum":
            for p in ddp.module.parameters():
                p.grad *= world
        opt.step()
        opt.zero_grad()

    def max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
        return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters()))

    out: dict[str, float] = {}

    # 1. across calls: two forward/backward calls, then a call that also steps
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    @spmd_backend.compile(parallel_mode=mode)
    def forward_backward(model, x):
        loss_of(model, x).backward()

    @spmd_backend.compile(parallel_mode=mode)
    def last_micro_batch(model, optim, x):
        loss_of(model, x).backward()
        optim.step()
        optim.zero_grad()

    ref, ref_opt, ddp = ddp_reference()
    for i in range(0, 6, 3):
        forward_backward(model, batches[i])
        forward_backward(model, batches[i + 1])
        last_micro_batch(model, opt, batches[i + 2])
        ddp_accumulate(ddp, ref_opt, batches[i : i + 3])
    out["across_calls"] = max_diff(model, ref)

    # 2. several backward calls inside one step: one all_reduce per parameter
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    @spmd_backend.compile(parallel_mode=mode)
    def micro_batched(model, optim, xs):
        for x in xs:
            loss_of(model, x).backward()
        optim.step()
        optim.zero_grad()

    ref, ref_opt, ddp = ddp_reference()
    for i in range(0, 6, 3):
        micro_batched(model, opt, batches[i : i + 3])
        ddp_accumulate(ddp, ref_opt, batches[i : i + 3])
    out["inside_one_step"] = max_diff(model, ref)
    graph = micro_batched.graph.traced.gm.graph
    out["all_reduces_inside_one_step"] = sum(ops.is_all_reduce(n) for n in graph.nodes)

    # 3. zero_grad(set_to_none=False): every call starts from an existing zero .grad
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    @spmd_backend.compile(parallel_mode=mode)
    def keep_grads(model, optim, x):
        loss_of(model, x).backward()
        optim.step()
        optim.zero_grad(set_to_none=False)

    ref, ref_opt, ddp = ddp_reference()
    for x in batches:
        keep_grads(model, opt, x)
        ddp_accumulate(ddp, ref_opt, [x])
    out["zeroed_grads"] = max_diff(model, ref)

    # 4. the step reads the gradient between two backward calls (a norm it returns): that read
    #    sees the reduced gradient, as with DDP, and the second contribution is reduced alone
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    @spmd_backend.compile(parallel_mode=mode)
    def read_between(model, optim, xs):
        loss_of(model, xs[0]).backward()
        norm = torch.stack([p.grad.norm() for p in model.parameters()]).norm()
        loss_of(model, xs[1]).backward()
        optim.step()
        optim.zero_grad()
        return norm

    ref, ref_opt, ddp = ddp_reference()
    for i in range(0, 6, 2):
        norm = read_between(model, opt, batches[i : i + 2])
        loss_of(ddp, batches[i]).backward()  # DDP reduces each backward (no no_sync)
        ref_norm = torch.stack([p.grad.norm() for p in ref.parameters()]).norm()
        if reduce_op == "sum":
            ref_norm = ref_norm * world
        loss_of(ddp, batches[i + 1]).backward()
        if reduce_op == "sum":
            for p in ref.parameters():
                p.grad *= world
        ref_opt.step()
        ref_opt.zero_grad()
        out["read_between_norm"] = max(out.get("read_between_norm", 0.0), float((norm - ref_norm).abs()))
    out["read_between"] = max_diff(model, ref)
    return out


@pytest.mark.parametrize("reduce_op", ["sum", "avg"])
def test_accumulation_matches_ddp_no_sync(rank_pool, reduce_op):
    for result in rank_pool.run(_job, reduce_op):
        assert result.pop("all_reduces_inside_one_step") == 4  # 2 layers x (weight, bias)
        for case, diff in result.items():
            assert diff < 1e-5, f"{case}: max parameter difference {diff} vs DDP"


def _dynamo_job(rank: int, world: int) -> dict[str, float]:
    """The same through ``torch.compile(..., backend="spmd")``, in the forms torch.compile users
    write: a compiled forward/backward with the optimizer stepped eagerly every other call (the
    pass that re-inplaces the gradient accumulation crashed on it), a compiled step that steps
    only when told to, and a step without zero_grad (gradients accumulate forever)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from spmd_backend.testing.models import MLP

    torch.manual_seed(0)
    base = MLP(8, 16, 2, 4)
    gen = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randn(4, 8, generator=gen) for _ in range(6)]
    out: dict[str, float] = {}

    def loss_of(model, x):
        return model(x).pow(2).mean()

    def pair():
        model = copy.deepcopy(base)
        ref = copy.deepcopy(base)
        return (model, torch.optim.AdamW(model.parameters(), lr=1e-2), DDP(ref),
                torch.optim.AdamW(ref.parameters(), lr=1e-2))

    def forward_backward(model, x):
        loss = loss_of(model, x)
        loss.backward()
        return loss

    def step_when_told(model, opt, x, do_step):
        loss_of(model, x).backward()
        if do_step:
            opt.step()
            opt.zero_grad()

    def never_zeroed(model, opt, x):
        loss_of(model, x).backward()
        opt.step()

    for name, fn in [("fb_then_eager_step", forward_backward), ("step_when_told", step_when_told),
                     ("never_zeroed", never_zeroed)]:
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend="spmd", options={"inductor": False})
        model, opt, ddp, ref_opt = pair()
        for i, x in enumerate(batches):
            do_step = i % 2 == 1
            if name == "fb_then_eager_step":
                compiled(model, x)
                if do_step:
                    opt.step()
                    opt.zero_grad()
            elif name == "step_when_told":
                compiled(model, opt, x, do_step)
            else:
                compiled(model, opt, x)
            loss_of(ddp, x).backward()  # all-reduces every micro-batch: the same sum
            if do_step or name == "never_zeroed":
                ref_opt.step()
                if name != "never_zeroed":
                    ref_opt.zero_grad()
        out[name] = max(float((p - q).abs().max())
                        for p, q in zip(model.parameters(), ddp.module.parameters()))
    return out


def test_accumulation_through_dynamo_matches_ddp(rank_pool):
    for result in rank_pool.run(_dynamo_job):
        for case, diff in result.items():
            assert diff < 1e-5, f"{case}: max parameter difference {diff} vs DDP"
