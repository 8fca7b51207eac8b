"""Pass declaration, ordering and verification (PassManager and the legacy decorator)."""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.fx as fx

from spmd_backend import PassManager
from spmd_backend.errors import SpmdGraphError, SpmdPassError
from spmd_backend.graph import ops
from spmd_backend.graph.invariants import verify_graph
from spmd_backend.graph.meta import annotate
from spmd_backend.graph_optimization import _optimized_func, graph_optimization_pass
from spmd_backend.iter_graph_module import IterGraphModule
from spmd_backend.pass_manager import declare_pass

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


# The seed's GraphPassWrapperTest.test_order lives in tests/test_seed_transformation.py.


def test_legacy_decorator_refuses_twice_and_runs_post_pass_work():
    calls = []

    @graph_optimization_pass(prerequisites=[], apply_after=[])
    def count_pass(gm) -> None:
        calls.append(gm)

    gm = fx.symbolic_trace(torch.nn.Linear(2, 2))
    _optimized_func.clear()
    count_pass(gm)
    assert "count_pass" in _optimized_func and calls == [gm]
    with pytest.raises(AssertionError, match="Cannot apply count_pass twice"):
        count_pass(gm)
    _optimized_func.clear()



def test_seed_face_wraps_the_plain_passes_and_keeps_the_upstream_contract():
    from spmd_backend import graph_optimization as seed
    from spmd_backend import passes

    _optimized_func.clear()
    try:
        with pytest.raises(AssertionError, match=r"\['comm_fusion_with_concat'\] are the prerequisites of schedule_comm_wait"):
            seed.schedule_comm_wait(_comm_graph())
        seed.comm_fusion_with_concat(_comm_graph())
        with pytest.raises(AssertionError, match="Cannot apply comm_fusion_with_concat twice"):
            seed.comm_fusion_with_concat(_comm_graph())
        seed.schedule_comm_wait(_comm_graph())
        assert _optimized_func == {"comm_fusion_with_concat", "schedule_comm_wait"}
    finally:
        _optimized_func.clear()
    # the plain passes: any graph, any order, as often as asked; the seed record is untouched
    for gm in (_comm_graph(), _comm_graph()):
        passes.schedule_comm_wait(gm)
        passes.comm_fusion_with_concat(gm)
        passes.comm_fusion_with_concat(gm)  # nothing left to fuse: a logged no-op
        assert sum(ops.is_all_reduce(n) for n in gm.graph.nodes) == 1
    assert _optimized_func == set()
    assert PassManager([seed.schedule_comm_wait, seed.comm_fusion_with_concat]).order == [
        "comm_fusion_with_concat", "schedule_comm_wait"
    ], "a seed wrapper names the declaration of the plain pass it wraps"

# ----------------------------------------------------------------------------- PassManager
def _toy_gm() -> fx.GraphModule:
    def f(x, y):
        return (x + y).relu() * 2

    return fx.symbolic_trace(f)


def _mk(name, *, pre=(), after=(), log_to=None, reorders=False):
    def fn(gm):
        if log_to is not None:
            log_to.append(name)

    fn.__name__ = name
    return declare_pass(fn, prerequisites=pre, apply_after=after, reorders_collectives=reorders)


def test_manager_sorts_by_dependencies_stably():
    ran = []
    a = _mk("pm_a", log_to=ran)
    b = _mk("pm_b", pre=[a], log_to=ran)
    c = _mk("pm_c", after=[b], log_to=ran)
    d = _mk("pm_d", log_to=ran)
    pm = PassManager([c, d, b, a])
    assert pm.order == ["pm_d", "pm_a", "pm_b", "pm_c"]
    records = pm.run(_toy_gm())
    assert ran == pm.order
    assert [r.name for r in records] == pm.order and all(r.seconds >= 0 for r in records)


def test_apply_after_is_only_an_order_when_both_are_scheduled():
    a = _mk("pm_only_a")
    c = _mk("pm_after_missing", after=["pm_not_scheduled"])
    assert PassManager([c, a]).order == ["pm_after_missing", "pm_only_a"]


def test_missing_prerequisite_names_both_passes():
    a = _mk("pm_req")
    b = _mk("pm_needs", pre=[a])
    with pytest.raises(SpmdPassError, match=r"\['pm_req'\] are the prerequisites of pm_needs"):
        PassManager([b])


def test_cycle_names_its_passes():
    _mk("pm_x", after=["pm_z"])
    _mk("pm_y", after=["pm_x"])
    _mk("pm_z", after=["pm_y"])
    with pytest.raises(SpmdPassError, match="cycle: .*pm_x.*pm_y.*pm_z|cycle: .*pm_y.*pm_z.*pm_x|cycle: .*pm_z.*pm_x.*pm_y"):
        PassManager(["pm_x", "pm_y", "pm_z"])


def test_skip_by_argument_and_environment(monkeypatch, caplog):
    ran = []
    a = _mk("pm_s1", log_to=ran)
    b = _mk("pm_s2", pre=[a], log_to=ran)
    c = _mk("pm_s3", log_to=ran)
    with caplog.at_level(logging.INFO, logger="spmd_backend.pass_manager"):
        records = PassManager([a, b, c], skip=["pm_s1"]).run(_toy_gm())
    assert ran == ["pm_s3"], "a pass whose prerequisite is skipped is skipped too"
    assert [r.skipped != "" for r in records] == [True, True, False]
    ran.clear()
    monkeypatch.setenv("SPMD_SKIP_PASSES", "pm_s3, pm_s2")
    PassManager([a, b, c]).run(_toy_gm())
    assert ran == ["pm_s1"]


def test_two_managers_and_two_graphs_are_isolated():
    seen = []

    def tag(gm):
        seen.append(id(gm))

    spec = declare_pass(tag, name="pm_tag")
    pm1, pm2 = PassManager([spec]), PassManager([spec])
    g1, g2 = _toy_gm(), _toy_gm()
    pm1.run(g1)
    pm1.run(g2)  # the same manager on a second graph: runs again, no "twice" error
    pm2.run(g1)
    assert seen == [id(g1), id(g2), id(g1)]


def test_post_pass_dce_keeps_side_effects_and_dumps(tmp_path):
    def add_dead_and_mutation(gm):
        g = gm.graph
        x = next(n for n in g.nodes if n.op == "placeholder")
        out = next(n for n in g.nodes if n.op == "output")
        with g.inserting_before(out):
            g.call_function(aten.neg.default, (x,))  # dead: removed
            g.call_function(aten.add_.Tensor, (x, 1))  # a mutation: kept

    spec = declare_pass(add_dead_and_mutation, name="pm_dce")
    gm = _toy_gm()
    PassManager([spec], dump_dir=str(tmp_path)).run(gm)
    targets = [n.target for n in gm.graph.nodes]
    assert aten.neg.default not in targets and aten.add_.Tensor in targets
    assert "add_" in gm.code
    dumped = sorted(os.listdir(tmp_path))
    assert dumped == ["00.pm_dce.after.main.graph", "00.pm_dce.before.main.graph"]


def _comm_graph() -> fx.GraphModule:
    """Two all_reduces on group "0" with their waits; fake values and annotations."""
    from spmd_backend.graph.meta import Phase, annotate

    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    ra = g.call_function(c10d.all_reduce.default, (a, "sum", "0"))
    wa = g.call_function(c10d.wait_tensor.default, (ra,))
    rb = g.call_function(c10d.all_reduce.default, (b, "sum", "0"))
    wb = g.call_function(c10d.wait_tensor.default, (rb,))
    g.output([wa, wb])
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        v = torch.empty(4)
    del mode
    for n in g.nodes:
        if n.op != "output":
            n.meta["val"] = v
        annotate(n, fqn="", phase=Phase.COMM)
    return fx.GraphModule(torch.nn.Module(), g)


def test_verification_catches_reordered_collectives_unless_declared():
    def swap(gm):
        ars = [n for n in gm.graph.nodes if ops.is_all_reduce(n)]
        ars[0].prepend(ars[1])
        wait_b = next(iter(ars[1].users))
        ars[0].prepend(wait_b)

    with pytest.raises(SpmdGraphError, match="relative order of collectives on group 0 changed"):
        PassManager([declare_pass(swap, name="pm_swap")]).run(_comm_graph())
    PassManager([declare_pass(swap, name="pm_swap_ok", reorders_collectives=True)]).run(_comm_graph())


def test_verification_catches_missing_wait_val_and_annotation():
    def drop_wait(gm):
        w = next(n for n in gm.graph.nodes if ops.is_wait(n))
        w.replace_all_uses_with(w.args[0])
        gm.graph.erase_node(w)

    with pytest.raises(SpmdGraphError, match="exactly one wait_tensor"):
        PassManager([declare_pass(drop_wait, name="pm_drop_wait")]).run(_comm_graph())

    def add_unannotated(gm):
        out = next(n for n in gm.graph.nodes if n.op == "output")
        with gm.graph.inserting_before(out):
            n = gm.graph.call_function(aten.add_.Tensor, (out.args[0][0], 1))
        n.meta["val"] = out.args[0][0].meta["val"]

    with pytest.raises(SpmdGraphError, match="has no phase annotation"):
        PassManager([declare_pass(add_unannotated, name="pm_unannotated")]).run(_comm_graph())

    def add_valless(gm):
        out = next(n for n in gm.graph.nodes if n.op == "output")
        with gm.graph.inserting_before(out):
            gm.graph.call_function(aten.add_.Tensor, (out.args[0][0], 1))

    with pytest.raises(SpmdGraphError, match="has no meta\\['val'\\]"):
        PassManager([declare_pass(add_valless, name="pm_valless")]).run(_comm_graph())


def test_verification_catches_a_write_to_what_a_collective_still_sends():
    """A write between a collective and its wait races with the process group reading the
    input (gloo sends from its own thread); through a view of the input too. After the wait it
    is fine."""

    def write_before_wait(view: bool):
        def run(gm):
            ra = next(n for n in gm.graph.nodes if ops.is_all_reduce(n))
            src = ra.args[0]
            with gm.graph.inserting_after(ra):
                n = gm.graph.call_function(aten.add_.Tensor, (src, 1))
                if view:
                    v = gm.graph.call_function(aten.view.default, (src, [-1]))
                    n.update_arg(0, v)
                    v.meta.update(src.meta)
            n.meta.update(src.meta)
        return run

    for view in (False, True):
        with pytest.raises(SpmdGraphError, match="add__tensor writes .* which collective all_reduce_default still reads"):
            PassManager([declare_pass(write_before_wait(view), name=f"pm_race_{view}")]).run(_comm_graph())

    def write_after_wait(gm):
        wa = next(n for n in gm.graph.nodes if ops.is_wait(n))
        with gm.graph.inserting_after(wa):
            n = gm.graph.call_function(aten.add_.Tensor, (wa.args[0].args[0], 1))
        n.meta.update(wa.meta)

    PassManager([declare_pass(write_after_wait, name="pm_no_race")]).run(_comm_graph())


def test_manager_runs_on_an_iter_graph_module():
    def neg_out(gm):
        g = gm.graph
        out = next(n for n in g.nodes if n.op == "output")
        with g.inserting_before(out):
            n = g.call_function(aten.neg.default, (out.args[0],))
        out.args = (n,)

    igm = IterGraphModule(_toy_gm())
    PassManager([declare_pass(neg_out, name="pm_neg_out")]).run(igm)
    igm.finalize_setup()
    x, y = torch.randn(3), torch.randn(3)
    torch.testing.assert_close(igm(x, y, last_iter=True), -((x + y).relu() * 2))


def test_undeclared_functions_do_not_leak_into_the_registry():
    from spmd_backend.pass_manager import _REGISTRY

    def pm_private_pass(gm):
        return None

    PassManager([pm_private_pass]).run(_toy_gm())
    assert "pm_private_pass" not in _REGISTRY


def _fused_adam_graph(state_shape: tuple[int, ...], grad_transposed: bool = False,
                      param: torch.Tensor | None = None) -> fx.Graph:
    """make_fx of torch's fused Adam kernel on a (3, 4) parameter (or ``param``), with the
    given state shape (states laid out like the parameter)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(p, g, m, v, s):
        grad = g.t() if grad_transposed else g
        torch._fused_adam_([p], [grad], [m], [v], [], [s], lr=0.1, beta1=0.9, beta2=0.99,
                           weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)
        return p

    p = torch.randn(3, 4) if param is None else param
    g = torch.randn(4, 3) if grad_transposed else torch.empty_like(p)
    state = torch.zeros_like(p) if tuple(state_shape) == tuple(p.shape) else torch.zeros(state_shape)
    gm = make_fx(step, tracing_mode="fake")(p, g, state, state.clone(), torch.tensor(1.0))
    for n in gm.graph.nodes:
        annotate(n, fqn=None, phase="optimizer")
    return gm.graph


def test_verification_catches_a_fused_optimizer_state_that_does_not_match_its_parameter():
    """torch's CPU fused kernels size every list by the parameter and check nothing (a shorter
    state is written out of bounds: heap corruption, a crash later and elsewhere), and read
    a parameter and its tensors as flat arrays (a transposed gradient is read wrong). One dense
    layout shared by all (a channels_last weight, as eager's gradient layout contract gives)
    is fine, as is the scalar step count of a one-element parameter (a shard)."""
    verify_graph(_fused_adam_graph((3, 4)))  # matching: fine
    with pytest.raises(SpmdGraphError, match=r"_fused_adam_ .* shape \(3, 4\) with .* shape \(6,\)"):
        verify_graph(_fused_adam_graph((6,)))
    with pytest.raises(SpmdGraphError, match=r"strides \(1, 3\).*with strides \(4, 1\).*one "
                                             r"dense layout"):
        verify_graph(_fused_adam_graph((3, 4), grad_transposed=True))
    channels_last = torch.randn(2, 3, 2, 2).to(memory_format=torch.channels_last)
    verify_graph(_fused_adam_graph((2, 3, 2, 2), param=channels_last))
    verify_graph(_fused_adam_graph((1,), param=torch.randn(1)))
