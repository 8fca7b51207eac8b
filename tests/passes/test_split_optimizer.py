"""split_fused_optimizer / get_all_fused_optimizer_blocks on tiny graphs (fake process group)."""

from __future__ import annotations

import pytest
from helpers import assert_same_training, run_pair

from spmd_backend.errors import SpmdPassError
from spmd_backend.graph.optim import get_optimizer_blocks
from spmd_backend.iter_graph_module import IterGraphModule
from spmd_backend.pass_manager import PassManager
from spmd_backend.passes import (
    get_all_fused_optimizer_blocks,
    remove_copy_from_optimizer,
    split_fused_optimizer,
)


def splitter(name, reinplace=True, count=None):
    def transformation(gm):
        igm = IterGraphModule(gm)
        if reinplace:
            PassManager([remove_copy_from_optimizer]).run(igm)
        (block,) = get_all_fused_optimizer_blocks(igm, name)
        grads = block.optim.optim_node.args[1]
        assert block.length == len(grads) == 6
        with_sel, rest = split_fused_optimizer(igm, block, {grads[1], grads[2]})
        assert with_sel.length == 2 and rest.length == 4
        assert with_sel.optim.optim_node.args[1] == [grads[1], grads[2]]
        if with_sel.step.add_node is not None:
            assert len(with_sel.step.add_node.args[0]) == 2
        blocks = get_all_fused_optimizer_blocks(igm, name)
        assert len(blocks) == 2
        if count is not None:
            count.append(len(blocks))
        igm.finalize_setup()
        return igm

    return transformation


@pytest.mark.parametrize(
    "optim_kind,name,reinplace",
    [
        ("adam_fused", "_fused_adam", True),
        ("adam_fused", "_fused_adam", False),
        ("adamw_fused", "_fused_adamw", True),
        ("sgd_fused", "_fused_sgd", True),
        ("adam_foreach", "_foreach", True),
        ("adam_foreach", "_foreach", False),
        ("sgd_foreach", "_foreach", True),
    ],
)
def test_split_then_train_equals_unsplit(fake_pg, optim_kind, name, reinplace):
    compiled, model, ref = run_pair(splitter(name, reinplace), optim_kind=optim_kind)
    assert_same_training(model, ref)


def test_split_refuses_foreign_gradients(fake_pg):
    def bad(gm):
        igm = IterGraphModule(gm)
        (block,) = get_optimizer_blocks(igm.graph)
        outsider = next(n for n in igm.graph.nodes if n.op == "placeholder")
        with pytest.raises(SpmdPassError, match="none of the given gradients"):
            split_fused_optimizer(igm, block, {outsider})
        return igm

    compiled, model, ref = run_pair(bad, optim_kind="adam_fused")
    assert_same_training(model, ref)
