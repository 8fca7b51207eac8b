"""AMP: autocast and ``torch.amp.GradScaler`` inside the compiled step, against DDP (2 ranks).

The step is written as users write it (``scaler.scale(loss).backward(); scaler.step(opt);
scaler.update()``), with the scaler passed as an argument or captured from the enclosing scope.
One case clips as torch's AMP recipe does (``scaler.unscale_(opt)``, ``clip_grad_norm_``,
``scaler.step``), over 4 micro-batches accumulated by one scaled backward each: the norm must be
the averaged gradients' (as DDP's, after its all_reduce), and the step must not unscale again;
that case runs through ``backend="spmd"`` too. One step gets an inf gradient on rank 1 only: after the
all_reduce both ranks must skip it (eager's ``found_inf``), back the scale off, and stay
identical to DDP, also on the very first step (where eager creates no optimizer state at all). With ``shard_optimizer=True`` the
scaler's unscale reads the full gradients (all_reduce, then each rank's slice) while the
optimizer steps on shards: the same result is required, and the state must really be sharded.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = pytest.mark.multirank

INF_STEPS = (0, 3)  # the first step (state creation) and a steady-state step


def _job(rank: int, world: int, impl: str, scaler_as_argument: bool,
         shard: bool = False, encoder: bool = False, clip: bool = False,
         micro_batches: int = 1, door: str = "compile") -> dict[str, float]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import spmd_backend
    from spmd_backend.testing.models import MLP
    from spmd_backend.testing.steps import amp_step

    torch.manual_seed(0)
    if encoder:  # torch's own module (unbatched input: 8 tokens of width 8)
        model = torch.nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=32, dropout=0.0)
    else:
        model = MLP(8, 32, 3, 4)
    ref = copy.deepcopy(model)
    ddp = DDP(ref)
    kw = {"fused": True} if impl == "fused" else {}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **kw)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, **kw)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)

    # clip: a norm between the gradients' norms of some steps, so it clips some and not others
    train_step = amp_step("cpu", torch.bfloat16, clip_norm=0.1 if clip else None,
                          micro_batches=micro_batches)

    def closure_step(model, optim, x):
        return train_step(model, optim, x, scaler)

    mode = spmd_backend.DataParallel(reduce_op="avg", shard_optimizer=shard)
    if door == "dynamo":
        from torch._dynamo.utils import counters

        # the rank pool's processes outlive a job: count this job's graphs only
        torch._dynamo.reset()
        counters["spmd"].clear()
        # no Inductor: its bfloat16 kernels round differently from eager's (8e-05 here)
        dynamo_step = torch.compile(train_step, backend="spmd", options={
            "reduce_op": "avg", "shard_optimizer": shard, "inductor": False})
        run = lambda x: dynamo_step(model, opt, x, scaler)  # noqa: E731
    elif scaler_as_argument:
        compiled = spmd_backend.compile(parallel_mode=mode)(train_step)
        run = lambda x: compiled(model, opt, x, scaler)  # noqa: E731
    else:
        compiled = spmd_backend.compile(parallel_mode=mode)(closure_step)
        run = lambda x: compiled(model, opt, x)  # noqa: E731

    gen = torch.Generator().manual_seed(10 + rank)
    out: dict[str, float] = {}
    for i in range(6):
        x = torch.randn(8, 8, generator=gen)
        if i in INF_STEPS and rank == 1:
            x[0, 0] = float("inf")
        run(x)
        train_step(ddp, ref_opt, x, ref_scaler)
        if i == 0:
            out["state_after_skipped_first_step"] = float(len(opt.state) - len(ref_opt.state))
    out["scale"] = scaler.get_scale() - ref_scaler.get_scale()
    out["params"] = max(float((p - q).abs().max()) for p, q in zip(model.parameters(), ref.parameters()))
    state, ref_state = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    out["state"] = max(
        float((v - ref_state[i][k]).abs().max())
        for i, s in state.items() for k, v in s.items()
    )
    out["skipped_steps"] = float(sum(1 for s in opt.state.values() if s["step"] < 6 - len(INF_STEPS)))
    if door == "dynamo":
        # per-graph mode: Dynamo ran (part of) the step eagerly around separate graphs
        out["per_graph_graphs"] = float(counters["spmd"]["per_graph_graphs"])
    out["live_state_elements"] = float(sum(s["exp_avg"].numel() for s in opt.state.values()))
    out["full_state_elements"] = float(sum(p.numel() for p in model.parameters()))
    return out


@pytest.mark.parametrize(
    "impl,scaler_as_argument,shard,encoder,clip,micro_batches,door",
    [("default", True, False, False, False, 1, "compile"),
     ("fused", False, False, False, False, 1, "compile"),
     ("default", True, True, False, False, 1, "compile"),
     ("default", True, True, True, False, 1, "compile"),
     ("default", True, False, False, True, 4, "compile"),
     # Dynamo traces GradScaler.scale in the micro-batch loop (it ran the step eagerly before)
     ("default", True, False, False, True, 4, "dynamo")],
)
def test_grad_scaler_matches_ddp_with_skipped_steps(
    rank_pool, impl, scaler_as_argument, shard, encoder, clip, micro_batches, door
):
    for out in rank_pool.run(_job, impl, scaler_as_argument, shard, encoder, clip, micro_batches,
                             door):
        if door == "compile":  # the Dynamo door creates a fresh optimizer's state up front
            assert out["state_after_skipped_first_step"] == 0.0, out
        else:  # forward and scaled backwards of the loop in the step's graph; at most the
            # rest after GradScaler.step's host read of found_inf in another (3 graphs before)
            assert out["per_graph_graphs"] <= 1.0, out
        assert out["scale"] == 0.0
        assert out["params"] < 1e-5 and out["state"] < 1e-5, out
        assert out["skipped_steps"] == 0.0  # every parameter took exactly 4 optimizer steps
        if shard:  # each rank holds about half of the moments
            assert out["live_state_elements"] < 0.6 * out["full_state_elements"], out
        else:
            assert out["live_state_elements"] == out["full_state_elements"], out


def _amp_pair(fused: bool):
    """A model, its copy, an AdamW for each and a GradScaler for each."""
    from spmd_backend.testing.models import MLP

    torch.manual_seed(0)
    model = MLP(8, 16, 2, 4)
    ref = copy.deepcopy(model)
    kw = {"fused": True} if fused else {}
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, **kw) for m in (model, ref)]
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10) for _ in range(2)]
    return model, ref, opts, scalers


def test_a_fused_optimizer_traced_single_tensor_takes_the_scalers_select_path(fake_pg):
    """betas[0] moving every call (OneCycleLR's cycle_momentum) traces a fused AdamW group
    single-tensor; a GradScaler then handed it grad_scale/found_inf and the trace failed on
    torch's assertion at the third call, and at every later one (until 2026-11-28)."""
    from spmd_backend.testing.steps import amp_step, compiled_by

    model, ref, (opt, ref_opt), (scaler, ref_scaler) = _amp_pair(fused=True)
    step = amp_step("cpu", torch.bfloat16)
    compiled = compiled_by("compile", step)
    gen = torch.Generator().manual_seed(0)
    for i in range(4):
        for o in (opt, ref_opt):
            o.param_groups[0]["betas"] = (0.9 - 0.02 * i, 0.999)
        x = torch.randn(8, 8, generator=gen)
        compiled(model, opt, x, scaler)
        step(ref, ref_opt, x, ref_scaler)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    assert scaler.get_scale() == ref_scaler.get_scale()


def _stepped_then_refused(model, optim, x, scaler):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(optim)
    if loss > 1e6:  # a Python decision on a tensor: the compile door refuses it
        optim.zero_grad()
    scaler.update()
    optim.zero_grad()


def _stepped_not_updated(model, optim, x, scaler):
    scaler.scale(model(x).pow(2).mean()).backward()
    scaler.step(optim)
    optim.zero_grad()


@pytest.mark.parametrize("step", [_stepped_then_refused, _stepped_not_updated])
def test_a_refused_amp_step_leaves_the_scaler_usable(fake_pg, step):
    """A trace that fails after ``scaler.step`` left the scaler's per-optimizer record holding
    the trace's fake ``found_inf`` (until 2026-11-28): the next ``scaler.update()`` and every eager
    AMP step failed. ``scaler.update()`` outside the step is refused by name, nothing changed."""
    import spmd_backend
    from spmd_backend.testing.steps import amp_step, compiled_by

    model, _, (opt, _), (scaler, _) = _amp_pair(fused=False)
    before = copy.deepcopy(model.state_dict())
    x = torch.randn(8, 8)
    with pytest.raises(spmd_backend.SpmdError) as raised:
        compiled_by("compile", step)(model, opt, x, scaler)
    if step is _stepped_not_updated:
        assert "scaler.update()" in str(raised.value)
    assert dict(scaler._per_optimizer_states) == {}
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters()) and not opt.state
    amp_step("cpu", torch.bfloat16)(model, opt, x, scaler)  # eager AMP goes on with the scaler
    assert opt.state
