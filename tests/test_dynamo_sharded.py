"""``torch.compile(step, backend="spmd", options={"shard_optimizer": True})``: sharded optimizer
state through the Dynamo door, on 2 gloo ranks.

Parity with DDP (parameters, and the full optimizer state through ``state_dict()``) for Adam,
SGD with momentum (bit for bit, also with DDP's fp16 compression hook), two param groups, fused Adam, single-tensor AdamW on uneven and tiny parameters,
transformers' GPT-2 and torch's TransformerEncoder with AdamW; each rank holding half of the state; a state_dict round
trip continuing exactly like the uninterrupted run; an optimizer the compiled function reaches
only through an attribute; refusals. The negative control replaces the gradient reduce_scatter by
a local slice: parity must then fail.
"""

from __future__ import annotations

import copy
import pathlib

import pytest
import torch
import torch.nn as nn

from spmd_backend.testing.parity import OptimSpec, ParityCase, check_ddp_parity

pytestmark = pytest.mark.multirank

SHARD = {"shard_optimizer": True}
SHARD_FX = {"shard_optimizer": True, "inductor": False}


def _uneven():
    from test_sharded_optimizer import UNEVEN  # tests/ is on sys.path (rootdir conftest)

    return UNEVEN


def _parity(rank: int, world: int, case: ParityCase) -> dict:
    result = check_ddp_parity(rank, world, case)
    return {"param": result.max_param_diff, "state": result.max_state_diff, "dynamo": result.dynamo}


CASES = {
    "mlp-adam-inductor": lambda: ParityCase(
        "mlp", OptimSpec("adam", "foreach"), steps=4, shard_optimizer=True, dynamo_options=SHARD),
    "mlp-sgd-momentum": lambda: ParityCase(
        "mlp", OptimSpec("sgd", "single", lr=0.05, momentum=0.9), steps=4, reduce_op="avg",
        shard_optimizer=True, dynamo_options=SHARD_FX),
    "mlp-sgd-momentum-fp16-compressed": lambda: ParityCase(  # DDP + fp16_compress_hook
        "mlp", OptimSpec("sgd", "single", lr=0.05, momentum=0.9), steps=4, reduce_op="avg",
        gradient_compression="fp16", shard_optimizer=True, dynamo_options=SHARD_FX),
    "mlp-adam-single-2groups": lambda: ParityCase(
        "mlp", OptimSpec("adam", "single", param_groups=2, weight_decay=0.01), steps=4,
        reduce_op="avg", shard_optimizer=True, dynamo_options=SHARD_FX),
    "mlp-adam-fused-avg": lambda: ParityCase(
        "mlp", OptimSpec("adam", "fused", weight_decay=0.01), steps=4, reduce_op="avg",
        shard_optimizer=True, dynamo_options=SHARD_FX),
    "uneven-adamw-single": lambda: ParityCase(
        _uneven(), OptimSpec("adamw", "single", weight_decay=0.1), steps=4, shard_optimizer=True,
        dynamo_options=SHARD_FX),
    "uneven-adamw-single-reduce-scatter": lambda: ParityCase(
        _uneven(), OptimSpec("adamw", "single", weight_decay=0.1), steps=4, shard_optimizer=True,
        dynamo_options=SHARD_FX, reduce_scatter_grads=True),
    "mlp-adam-zero-grad-first": lambda: ParityCase(  # the gradients outlive the step
        "mlp", OptimSpec("adam", "foreach"), steps=4, reduce_op="avg", shard_optimizer=True,
        dynamo_options=SHARD_FX, zero_grad_first=True),
    "hf_gpt2-adamw": lambda: ParityCase(  # transformers' GPT-2 (tiny config, random init)
        "hf_gpt2", OptimSpec("adamw", "foreach", lr=1e-3, weight_decay=0.01), steps=3,
        reduce_op="avg", shard_optimizer=True, dynamo_options=SHARD_FX),
    "torch_encoder-adamw": lambda: ParityCase(
        "torch_encoder", OptimSpec("adamw", "foreach", lr=1e-3, weight_decay=0.01), steps=3,
        reduce_op="avg", shard_optimizer=True, dynamo_options=SHARD_FX),
}


@pytest.mark.parametrize("name", list(CASES))
def test_parity_with_ddp(rank_pool, name: str) -> None:
    results = rank_pool.run(_parity, CASES[name]())
    for r in results:
        assert r["dynamo"]["whole_step_graphs"] >= 1 and r["dynamo"]["graph_breaks"] == 0, r
    if name.startswith("mlp-sgd-momentum"):  # elementwise, and halving is exact: bit for bit
        assert all(r["param"] == 0.0 and r["state"] == 0.0 for r in results), results


# ----------------------------------------------------------------------------- negative control
def _slice_locally(rank: int, world: int, case: ParityCase) -> dict:
    """Each rank slices its own, unreduced gradient instead of the reduce_scatter's result."""
    from test_sharded_optimizer import _local_slice_instead_of_reduce_scatter

    import spmd_backend.pipeline as pipeline

    expand = pipeline.expand

    def expand_then_slice(gm, config, **kwargs):
        report = expand(gm, config, **kwargs)
        _local_slice_instead_of_reduce_scatter(gm)
        return report

    pipeline.expand = expand_then_slice
    try:  # the step cache would serve the unpatched compile
        with torch._functorch.config.patch(enable_autograd_cache=False):
            return _parity(rank, world, case)
    finally:
        pipeline.expand = expand


def test_negative_control_fails(rank_pool) -> None:
    case = ParityCase("mlp", OptimSpec("adam", "foreach"), steps=3, shard_optimizer=True,
                      dynamo_options=SHARD_FX, reduce_scatter_grads=True)
    with pytest.raises(Exception, match="not close"):
        rank_pool.run(_slice_locally, case)


# ----------------------------------------------------------------------------- state layout
def _mlp_and_opt(seed: int = 0):
    from spmd_backend.testing.models import MLP

    torch.manual_seed(seed)
    model = MLP(32, 64, 3, 8)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)


def _step(model, opt, x):
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _batches(rank: int, start: int, stop: int):
    for i in range(start, stop):
        yield torch.randn(8, 32, generator=torch.Generator().manual_seed(1000 * i + rank))


def _round_trip_job(rank: int, world: int) -> dict:
    """Half of the state per rank; state_dict() full on every rank; loading it re-shards; a new
    optimizer loaded from it continues exactly like the uninterrupted one."""
    import logging

    torch._dynamo.reset()
    moved: list[str] = []  # torch 2.13's gloo: one all_gather in flight (parallel/gloo_all_gather)
    handler = logging.Handler()
    handler.emit = lambda record: moved.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("spmd_backend.parallel.gloo_all_gather")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    options = {"shard_optimizer": True, "reduce_op": "avg", "inductor": False}
    model, opt = _mlp_and_opt()
    step = torch.compile(_step, backend="spmd", options=options)
    try:
        for x in _batches(rank, 0, 3):
            step(model, opt, x)
    finally:
        logger.removeHandler(handler)
    moments = sum(v.numel() for s in opt.state.values() for k, v in s.items() if k != "step")
    full = sum(2 * p.numel() for p in model.parameters())
    sd = opt.state_dict()  # every rank takes part (an all_gather per state tensor)
    full_shape = tuple(sd["state"][0]["exp_avg"].shape)

    opt.load_state_dict(copy.deepcopy(sd))  # as from a checkpoint file: re-sharded at load
    loaded = {tuple(v.shape) for s in opt.state.values() for k, v in s.items() if k != "step"}
    model2 = copy.deepcopy(model)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.01, weight_decay=0.01)
    opt2.load_state_dict(copy.deepcopy(sd))  # full state; sharded when the step first runs
    for x in _batches(rank, 3, 6):
        step(model, opt, x)
        step(model2, opt2, x)
    same = all(torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters()))
    return {"fraction": moments / full, "full_shape": full_shape, "loaded": loaded, "same": same,
            "gathers_serialized": any("wait(s) moved up" in m for m in moved)}


def test_state_is_sharded_and_round_trips(rank_pool) -> None:
    for r in rank_pool.run(_round_trip_job):
        assert 0.49 <= r["fraction"] <= 0.52, r  # half of AdamW's two moments per rank
        assert r["full_shape"] == (64, 32), r
        assert all(len(s) == 1 for s in r["loaded"]), r  # re-sharded at load
        assert r["same"], r
        assert r["gathers_serialized"], r  # the Dynamo door's graphs are legalized too


def _asgd_job(rank: int, world: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch._dynamo.reset()
    model, _ = _mlp_and_opt()
    ref = copy.deepcopy(model)
    opt = torch.optim.ASGD(model.parameters(), lr=0.01, t0=1.0, foreach=False)
    ref_opt = torch.optim.ASGD(ref.parameters(), lr=0.01, t0=1.0, foreach=False)
    ddp = DDP(ref)
    step = torch.compile(_step, backend="spmd", options={**SHARD_FX, "reduce_op": "avg"})
    for x in _batches(rank, 0, 4):
        step(model, opt, x)
        _step(ddp, ref_opt, x)
    params = max(float((p - q).abs().max()) for p, q in zip(model.parameters(), ref.parameters()))
    ours, theirs = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    ax = max(float((ours[i]["ax"] - theirs[i]["ax"]).abs().max()) for i in theirs)
    return {"params": params, "ax": ax}


def test_asgd_averaging_matches_ddp(rank_pool) -> None:
    # ASGD reads the new parameter shard (ax += (p - ax) * mu) after its all_gather is issued;
    # the graph once subtracted in place from the shard gloo was still sending (0.35 off DDP
    # after two steps). tests/passes/test_remove_copy.py checks the graph itself
    for r in rank_pool.run(_asgd_job):
        assert r["params"] < 1e-6 and r["ax"] < 1e-6, r


class _Trainer:
    """The optimizer reached only through an attribute (not a local of the compiled frame)."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt

    def step(self, x: torch.Tensor) -> torch.Tensor:
        loss = self.model(x).pow(2).mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return loss


def _attribute_job(rank: int, world: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch._dynamo.reset()
    model, opt = _mlp_and_opt()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.01)
    ddp = DDP(ref)
    trainer = _Trainer(model, opt)
    step = torch.compile(trainer.step, backend="spmd",
                         options={"shard_optimizer": True, "reduce_op": "avg", "inductor": False})
    for x in _batches(rank, 0, 3):
        step(x)
        ddp(x).pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)
    return {"shapes": {tuple(v.shape) for s in opt.state.values() for k, v in s.items() if k != "step"}}


def test_optimizer_reached_through_an_attribute_is_sharded(rank_pool) -> None:
    for r in rank_pool.run(_attribute_job):
        assert all(len(s) == 1 for s in r["shapes"]), r


def _per_graph_job(rank: int, world: int) -> set:
    """A graph break inside the model (per-graph mode): the optimizer-step graph updates shards
    too (its gradients arrive all-reduced from the backward graphs and are sliced)."""
    from test_dynamo_backend import _Split
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Split(eager=False)
    ref = copy.deepcopy(model)
    ddp = DDP(ref)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    step = torch.compile(_step, backend="spmd",
                         options={"shard_optimizer": True, "reduce_op": "avg", "inductor": False})
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x = torch.randn(4, 8, generator=gen)
        step(model, opt, x)
        _step(ddp, ref_opt, x)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)
    return {tuple(v.shape) for s in opt.state.values() for k, v in s.items() if k != "step"}


def test_per_graph_mode_shards_too(rank_pool) -> None:
    for shapes in rank_pool.run(_per_graph_job):
        assert shapes == {(32,), (4,), (8,), (1,)}, shapes  # 8x8, 8, 2x8 halved; the 2-bias: 1


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.Adafactor(ps, lr=0.01),
    lambda ps: type("MyAdam", (torch.optim.Adam,), {})(ps, lr=0.01),  # its update is adam.adam
], ids=["Adafactor", "Adam-subclass"])
def test_non_elementwise_optimizer_is_refused_naming_the_option(fake_pg, make) -> None:
    from spmd_backend.errors import SpmdUsageError

    torch._dynamo.reset()
    model = nn.Linear(4, 4)
    opt = make(model.parameters())
    before = copy.deepcopy(model.state_dict())
    step = torch.compile(_step, backend="spmd", options={"shard_optimizer": True})
    with pytest.raises(Exception, match=r'options=\{"shard_optimizer": True\}: \w+ is not supported') as info:
        step(model, opt, torch.randn(2, 4))
    # raised by the backend, as Dynamo reports every backend error (not as an internal error)
    assert isinstance(getattr(info.value, "inner_exception", None), SpmdUsageError), repr(info.value)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert not opt.state and all(p.grad is None for p in model.parameters())


def test_shard_optimizer_option_must_be_a_bool() -> None:
    from spmd_backend.errors import SpmdUsageError
    from spmd_backend.pipeline import PipelineConfig

    assert PipelineConfig.from_options({"shard_optimizer": True}, "dynamo").parallel.shard_optimizer
    assert not PipelineConfig.from_options({}, "dynamo").parallel.shard_optimizer
    with pytest.raises(SpmdUsageError, match="shard_optimizer='yes'"):
        PipelineConfig.from_options({"shard_optimizer": "yes"}, "dynamo")


# ----------------------------------------------------------------------------- a failed step
def _killed_peer_job(rank: int, world: int, out: str, inductor: bool) -> None:
    """Rank 1 dies between steps; rank 0's next step must raise a named error and leave its
    parameters, gradients and shards of the optimizer state as they were (written to ``out``:
    the pool reports rank 1's exit, not rank 0's result)."""
    import json
    import os

    torch._dynamo.reset()
    model, opt = _mlp_and_opt()
    step = torch.compile(_step, backend="spmd", options={
        "shard_optimizer": True, "reduce_op": "avg", "inductor": inductor,
        "background_compile": False,
    })
    for x in _batches(rank, 0, 2):
        step(model, opt, x)
    if rank == 1:
        os._exit(3)
    params = [p.detach().clone() for p in model.parameters()]
    state = [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()]
    result: dict = {"error": None}
    try:
        step(model, opt, next(iter(_batches(rank, 2, 3))))
    except Exception as e:  # noqa: BLE001 - the test reports what it was
        result = {
            "error": f"{type(e).__name__}: {e}",
            "params": all(torch.equal(p, q) for p, q in zip(model.parameters(), params)),
            "state": all(torch.equal(opt.state[p][k], v) for p, s in zip(model.parameters(), state)
                         for k, v in s.items()),
            "grads": all(p.grad is None for p in model.parameters()),
        }
    pathlib.Path(out).write_text(json.dumps(result))


@pytest.mark.parametrize("inductor", [False, True], ids=["fx", "inductor"])
def test_a_failed_step_names_the_collective_and_changes_nothing(tmp_path, inductor: bool) -> None:
    """With the fx graph and with Inductor's code (the peer is gone before the step: the first
    collective fails, after the step counters were incremented in place)."""
    import json

    from spmd_backend.testing.ranks import RankPool

    out = tmp_path / "rank0.json"
    pool = RankPool(2, timeout=30, failure_grace=60)
    try:
        with pytest.raises(Exception, match="rank 1"):
            pool.run(_killed_peer_job, str(out), inductor, timeout=180)
    finally:
        pool.close(kill=True)
    result = json.loads(out.read_text())
    assert result["error"] is not None and result["error"].startswith("SpmdDistributedError"), result
    assert "collective of the compiled step failed" in result["error"], result
    assert result["params"] and result["state"] and result["grads"], result
