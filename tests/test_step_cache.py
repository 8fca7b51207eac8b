"""The Dynamo door's warm start (spmd_backend/dynamo/step_cache.py): a later compile of the same
step under the same configuration is served from AOTAutograd's cache and trains exactly like the
first; anything the compile reads besides the graph (configuration, process group, inputs' roles,
graph constants, this package's source) is in the key, so a change misses; graphs travel exactly
(spmd_backend/graph/serialize.py).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from spmd_backend.dynamo import step_cache
from spmd_backend.dynamo.graphs import DynamoInputs
from spmd_backend.errors import SpmdSerializationError
from spmd_backend.graph import serialize
from spmd_backend.parallel.data_parallel import DataParallel
from spmd_backend.pipeline import PipelineConfig
from spmd_backend.testing import OptimSpec, ParityCase, check_ddp_parity, fake_process_group
from spmd_backend.tracing.markers import GRAD_READY, PIPELINE_KEY


# ---------------------------------------------------------------------------- serialize
def _constant_step(x: torch.Tensor) -> torch.Tensor:
    c = torch.tensor([1.0, 2.0])  # a constant, lifted by a fresh copy, then mutated
    c.add_(x.sum())
    return GRAD_READY(x * c, "w") + 1


def test_graphs_travel_exactly():
    gm = make_fx(_constant_step)(torch.ones(2))
    with gm.graph.inserting_before(next(iter(gm.graph.find_nodes(op="output")))):
        gm.graph.call_function(PIPELINE_KEY, ("abc",))
    gm.recompile()
    for n in gm.graph.nodes:
        n.meta["spmd_phase"] = "forward"
    assert any("val" in n.meta for n in gm.graph.nodes)
    back = serialize.load(serialize.dump(gm))
    assert back.code == gm.code
    def rows(g):
        return [(n.op, n.name, str(n.target), str(n.args), str(n.kwargs)) for n in g.graph.nodes]

    assert rows(back) == rows(gm)
    targets = [n.target for n in back.graph.nodes]
    assert torch.ops.aten.lift_fresh_copy.default in targets  # pickle.dumps(gm) folds it away
    assert all(set(n.meta) == {"spmd_phase"} for n in back.graph.nodes)  # val etc. stay behind
    x = torch.tensor([0.5, 1.5])
    torch.testing.assert_close(back(x), gm(x))
    torch.testing.assert_close(back(x), gm(x))  # the constant is copied, not mutated, each call


def test_a_target_that_cannot_travel_is_named():
    def local(t):  # a function pickle cannot find by name
        return t + 1

    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(local, (x,), name="the_local"))
    with pytest.raises(SpmdSerializationError, match="the_local"):
        serialize.dump(fx.GraphModule({}, graph))


# ---------------------------------------------------------------------------- the key
def _graph_with_constant(value: float) -> fx.GraphModule:
    root = torch.nn.Module()
    root.register_buffer("c", torch.full((3,), value))
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.add, (x, graph.get_attr("c"))))
    return fx.GraphModule(root, graph)


INPUTS = DynamoInputs(kinds={0: "param", 1: "arg"}, fqns={0: "fc.weight"})


def _digest(gm=None, inputs=INPUTS, **config):
    return step_cache.digest(gm or _graph_with_constant(1.0), PipelineConfig(**config), inputs)


def test_the_key_covers_what_the_compile_reads(monkeypatch):
    with fake_process_group(world_size=2):
        base, reason = _digest()
        assert base is not None and reason == ""
        assert _digest()[0] == base  # stable
        changed = {
            "reduce_op": _digest(parallel=DataParallel(reduce_op="avg"))[0],
            "compression": _digest(parallel=DataParallel(gradient_compression="bf16"))[0],
            "bucket": _digest(bucket_size_mb=4)[0],
            "passes": _digest(passes=())[0],
            "skip": _digest(skip_passes=("schedule_comm_wait",))[0],
            "inductor": _digest(inductor=True)[0],
            "roles": _digest(inputs=DynamoInputs(kinds={0: "buffer", 1: "arg"},
                                                 fqns={0: "fc.weight"}))[0],
            "fqns": _digest(inputs=DynamoInputs(kinds=INPUTS.kinds, fqns={0: "fc.bias"}))[0],
            "constant": _digest(_graph_with_constant(2.0))[0],
        }
        monkeypatch.setenv("SPMD_SKIP_PASSES", "schedule_comm_wait")  # the pass manager's switch
        changed["env_skips"] = _digest()[0]
        monkeypatch.delenv("SPMD_SKIP_PASSES")
        monkeypatch.setenv("TORCHINDUCTOR_EMULATE_PRECISION_CASTS", "0")  # lowering's rounding
        changed["emulate_casts"] = _digest()[0]
        monkeypatch.delenv("TORCHINDUCTOR_EMULATE_PRECISION_CASTS")
        monkeypatch.setattr(step_cache, "source_digest", lambda: "another version")
        changed["source"] = _digest()[0]
    with fake_process_group(world_size=3):
        changed["world"] = step_cache.digest(_graph_with_constant(1.0), PipelineConfig(), INPUTS)[0]
    assert all(v is not None for v in changed.values()), changed
    assert len({base, *changed.values()}) == len(changed) + 1, changed


def test_what_cannot_be_keyed_is_not_cached(tmp_path, monkeypatch):
    def my_pass(gm):
        return gm

    with fake_process_group(world_size=2):
        assert _digest(dump_graphs=str(tmp_path)) == (None, "graph dumps were asked for")
        key, reason = _digest(extra_passes=(my_pass,))
        assert key is None and "'my_pass' is not one of this package's" in reason
        monkeypatch.setenv("SPMD_DUMP_GRAPHS", str(tmp_path))
        assert _digest() == (None, "graph dumps were asked for")


def test_a_scalar_constant_is_keyed_by_value():
    def graph_with(value):
        root = torch.nn.Module()
        root.register_buffer("c", torch.tensor(value))  # 0-dim: hashed, not an error
        graph = fx.Graph()
        x = graph.placeholder("x")
        graph.output(graph.call_function(torch.mul, (x, graph.get_attr("c"))))
        return fx.GraphModule(root, graph)

    with fake_process_group(world_size=2):
        a, b = (step_cache.digest(graph_with(v), PipelineConfig(), INPUTS)[0] for v in (0.5, 2.0))
    assert a is not None and b is not None and a != b


def test_a_stored_step_comes_back_with_every_value():
    # the lowering reads example values (placeholders for Inductor's inputs, a fused optimizer's
    # parameter dtypes): a rebuilt step must carry the same shapes, strides, offsets and dtypes
    import pickle
    from copy import copy

    from spmd_backend.iter_graph_module import IterGraphModule

    def f(p, g, x):
        h = (x.to(torch.bfloat16) * 2)[1:]
        return p.add_(g * h.float().sum()), h

    gm = make_fx(f)(torch.ones(3), torch.ones(3), torch.ones(4, 2))
    module = IterGraphModule(gm)
    module.finalize_setup()
    code = step_cache.StepOutputCode(module, None)
    stored = copy(code)
    stored.prepare_for_serialization()
    back = pickle.loads(pickle.dumps(stored))
    back.post_compile([], None, {})

    def vals(g):
        return [(n.name, [(tuple(v.shape), v.stride(), v.storage_offset(), v.dtype)
                          for v in (n.meta["val"] if isinstance(n.meta["val"], (list, tuple))
                                    else [n.meta["val"]])])
                for n in g.nodes if isinstance(n.meta.get("val"), (torch.Tensor, list, tuple))]

    assert vals(back.module.graph) == vals(module.graph)
    assert any(v[0][3] == torch.bfloat16 for _, v in vals(back.module.graph))
    args = [torch.zeros(3), torch.ones(3), torch.ones(4, 2)]
    expect = [torch.zeros(3), torch.ones(3), torch.ones(4, 2)]
    for got, want in zip(back([*args]), code([*expect])):
        torch.testing.assert_close(got, want)


def test_the_source_digest_is_of_this_package():
    assert step_cache.source_digest() == step_cache.source_digest()
    assert len(step_cache.source_digest()) == 64


# ---------------------------------------------------------------------------- end to end
_LOAD = serialize.load

def _mlp_step(model, optim, x):
    loss = model(x).square().mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _train(options: dict, steps: int = 3):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = torch.compile(_mlp_step, backend="spmd", options=options)
    gen = torch.Generator().manual_seed(1)
    losses = [float(step(model, opt, torch.randn(8, 8, generator=gen))) for _ in range(steps)]
    ours = counters["spmd"]
    return losses, copy.deepcopy(model.state_dict()), (ours["step_cache_saved"],
                                                       ours["step_cache_hits"])


def test_a_second_compile_is_served_from_the_cache_and_a_change_misses(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    fast = {"inductor": False}
    with fake_process_group(world_size=2):
        losses, params, counts = _train(fast)
        assert counts == (1, 0)  # compiled and stored
        hit_losses, hit_params, counts = _train(fast)
        assert counts == (0, 1)  # served
        assert hit_losses == losses
        for k in params:
            assert torch.equal(hit_params[k], params[k]), k
        assert _train({**fast, "reduce_op": "sum"})[2] == (1, 0)
        assert _train({**fast, "bucket_size_mb": 1})[2] == (1, 0)
        monkeypatch.setattr(step_cache, "source_digest", lambda: "a new release")
        assert _train(fast)[2] == (1, 0)
        monkeypatch.undo()
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))

        def unreadable(data):
            raise RuntimeError("a damaged entry")

        monkeypatch.setattr(serialize, "load", unreadable)
        damaged_losses, damaged_params, counts = _train(fast)
        assert counts == (0, 0)  # a failed load is a bypass: compiled again, not stored
        assert damaged_losses == losses
        for k in params:
            assert torch.equal(damaged_params[k], params[k]), k
        monkeypatch.setattr(serialize, "load", _LOAD)
        with torch._functorch.config.patch(enable_autograd_cache=False):
            assert _train(fast)[2] == (0, 0)  # torch's switch turns it off
        assert _train(fast)[2] == (0, 1)


@pytest.mark.multirank
@pytest.mark.parametrize(("model", "inductor"), [("mlp", False), ("hf_gpt2", False), ("mlp", True)])
def test_a_cached_step_matches_ddp(rank_pool, tmp_path, model, inductor):
    first, second = rank_pool.run(_twice_job, model, inductor, str(tmp_path))[0]
    assert (first.dynamo["cache_saved"], first.dynamo["cache_hits"]) == (1, 0), first.dynamo
    assert (second.dynamo["cache_saved"], second.dynamo["cache_hits"]) == (0, 1), second.dynamo
    assert second.losses == first.losses
    assert second.dynamo["whole_step_graphs"] == 1


def _twice_job(rank: int, world: int, model: str, inductor: bool, cache: str):
    """Two DDP parity runs on 2 ranks: the first compiles and stores the step, the second is
    served. Without Inductor the runs use a fresh cache folder; with it, the suite's (Inductor's
    code for the step is cached there) and a key of this job's own (so the first run misses)."""
    import uuid

    saved_dir, saved_digest = os.environ["TORCHINDUCTOR_CACHE_DIR"], step_cache.source_digest
    if inductor:
        nonce = f"{step_cache.source_digest()}-{uuid.uuid4()}"
        step_cache.source_digest = lambda: nonce
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    try:
        case = ParityCase(model, OptimSpec("adamw", "foreach", lr=1e-3, weight_decay=0.01),
                          steps=4, reduce_op="avg",
                          dynamo_options={"inductor": inductor, "background_compile": False})
        return check_ddp_parity(rank, world, case), check_ddp_parity(rank, world, case)
    finally:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved_dir
        step_cache.source_digest = saved_digest
