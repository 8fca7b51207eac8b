"""One all_gather in flight at a time on gloo (spmd_backend/parallel/gloo_all_gather.py).

torch 2.13's gloo corrupts the heap with two all_gather_into_tensor in flight at once (rank
aborts and segfaults in later, unrelated tests). Unit tests on graphs traced under a fake
process group; the 2-rank check that the sharded step's graphs, through both doors, never have
two all_gathers in flight is in tests/test_sharded_optimizer.py and tests/test_dynamo_sharded.py.
"""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from spmd_backend.graph import ops
from spmd_backend.parallel.gloo_all_gather import (
    max_all_gathers_in_flight,
    runs_on_gloo,
    serialize_all_gathers,
)

c10d = torch.ops._c10d_functional


def _three_gathers(group: str):
    def step(a, b, c):
        outs = [c10d.all_gather_into_tensor.default(t * 2, 2, group) for t in (a, b, c)]
        reduced = c10d.all_reduce.default(a + 1, "sum", group)
        waited = [c10d.wait_tensor.default(o) for o in outs]
        return waited[0].sum() + waited[1].sum() + waited[2].sum() + c10d.wait_tensor.default(reduced).sum()

    return step


def test_waits_move_up_so_one_all_gather_is_in_flight(fake_pg):
    group = fake_pg.group_name
    args = (torch.randn(3), torch.randn(5), torch.randn(2))
    gm = make_fx(_three_gathers(group))(*args)
    assert max_all_gathers_in_flight(gm.graph) == 3
    order = [n.op + str(n.target) for n in gm.graph.nodes]

    assert runs_on_gloo(group, torch.device("cpu")) is False  # the fake group is not gloo
    assert serialize_all_gathers(gm.graph) == 0  # so nothing moves by default
    assert [n.op + str(n.target) for n in gm.graph.nodes] == order

    assert serialize_all_gathers(gm.graph, affected=lambda g, d: g == group) == 2
    gm.recompile()
    assert max_all_gathers_in_flight(gm.graph) == 1
    nodes = list(gm.graph.nodes)
    gathers = [n for n in nodes if ops.is_call_to(n, c10d.all_gather_into_tensor.default)]
    for first, second in zip(gathers, gathers[1:]):
        (wait,) = first.users
        assert nodes.index(wait) < nodes.index(second)
    # the all_reduce and its wait did not move: still issued after the gathers, waited last
    reduce = next(n for n in nodes if ops.is_all_reduce(n))
    assert nodes.index(reduce) > nodes.index(gathers[-1])
    assert serialize_all_gathers(gm.graph, affected=lambda g, d: True) == 0  # idempotent
    out = gm(*args)  # the fake group's collectives run: the graph is still whole
    assert isinstance(out, torch.Tensor)


def test_another_group_is_left_alone(fake_pg):
    gm = make_fx(_three_gathers(fake_pg.group_name))(torch.randn(3), torch.randn(5), torch.randn(2))
    assert serialize_all_gathers(gm.graph, affected=lambda g, d: g == "not-this-one") == 0
    assert max_all_gathers_in_flight(gm.graph) == 3


def _gathers_then_waits_after_one_update(group: str):
    """Like the sharded step: one elementwise update makes every shard, then the gathers."""

    def step(a, b, c):
        shards = torch._foreach_mul([a, b, c], 0.5)
        outs = [c10d.all_gather_into_tensor.default(s, 2, group) for s in shards]
        return [c10d.wait_tensor.default(o).cos() for o in outs]

    return step


def _collective_calls(code: str) -> list[str]:
    import re

    calls = []
    for line in code.splitlines():
        if line.lstrip().startswith("#"):
            continue
        m = re.search(r"_c10d_functional\.(all_gather_into_tensor|wait_tensor)\.default\(", line)
        if m:
            calls.append(m.group(1))
    return calls


def test_inductor_keeps_the_waits_between_the_gathers(fake_pg):
    """Inductor's reorder_for_locality moved a wait past the next all_gather (gather, gather,
    wait in its code); the lowering turns it off for graphs kept one gather at a time."""
    from torch._inductor.utils import run_and_get_code

    from spmd_backend.lowering.inductor import lower_to_inductor

    args = (torch.randn(64), torch.randn(32), torch.randn(16))
    gm = make_fx(_gathers_then_waits_after_one_update(fake_pg.group_name), tracing_mode="fake")(*args)
    assert serialize_all_gathers(gm.graph, affected=lambda g, d: True) == 2
    gm.recompile()
    module, codes = run_and_get_code(lower_to_inductor, gm)
    calls = _collective_calls("\n".join(codes))
    assert calls == ["all_gather_into_tensor", "wait_tensor"] * 3, calls
    outs = module(*args)
    torch.testing.assert_close(outs[0], (torch.cat([args[0], args[0]]) * 0.5).cos())
