"""torch 2.13 decompositions that compute a wrong value are kept out of the step
(spmd_backend/tracing/decompositions.py).

``nn.MultiLabelMarginLoss`` with fewer labels than classes (targets padded with ``-1``): torch's
decomposition counts the padded slots, so stock ``torch.compile`` computes another loss than
eager. Every way a step is traced or lowered here must give eager's loss and update.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import spmd_backend
from spmd_backend.gm_transformation import GraphModuleTransformation
from spmd_backend.tracing.decompositions import WRONG_DECOMPOSITIONS, aten_kernels_kept

#: two labels of six in the first rows, then -1 padding; the last row uses every class
TARGETS = torch.tensor([[3, 0, -1, -1, -1, -1], [1, 2, -1, -1, -1, -1], [5, -1, 0, 0, 0, 0],
                        [0, 1, 2, 3, 4, 5]])


def _step(model, opt, x, t):
    loss = nn.functional.multilabel_margin_loss(model(x), t)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _compiled(door: str):
    if door.startswith("dynamo"):
        return torch.compile(_step, backend="spmd", options={
            "reduce_op": "sum", "inductor": door == "dynamo_inductor", "background_compile": False})
    transformation = (GraphModuleTransformation(enable_inductor=True, background_compile=False)
                      if door == "compile_inductor" else None)
    return spmd_backend.compile(parallel_mode=spmd_backend.DataParallel(reduce_op="sum"),
                                gm_transformation=transformation,
                                dynamic_batch=door == "compile_dynamic")(_step)


@pytest.mark.parametrize(
    "door", ["compile", "compile_dynamic", "compile_inductor", "dynamo", "dynamo_inductor"])
def test_multilabel_margin_loss_matches_eager(fake_pg, door):
    from torch._inductor.decomposition import fast_random_decomps

    # any Inductor compile earlier in the process builds the table copy Inductor reads, with
    # the op in it (review 42: the fix was bypassed then)
    fast_random_decomps()
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Linear(8, 6)
    twin = copy.deepcopy(model)
    opt, ref = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, twin))
    compiled = _compiled(door)
    # AOTAutograd's cache keys on the graph before decomposition: an entry made without the
    # fix would be served to it (and one made with it to a run without it)
    with torch._functorch.config.patch(enable_autograd_cache=False):
        for i in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
            got, want = compiled(model, opt, x, TARGETS), _step(twin, ref, x, TARGETS)
            torch.testing.assert_close(got, want, msg=f"loss of call {i}")
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)


def test_the_registrations_come_back_after_the_scope():
    from torch._C import DispatchKey
    from torch._inductor.decomposition import decompositions, select_decomp_table

    (op,) = WRONG_DECOMPOSITIONS
    kernel, decomposition = op.py_kernels[DispatchKey.Autograd], decompositions[op]
    with aten_kernels_kept():
        with aten_kernels_kept():  # nested: still removed inside, restored only at the end
            pass
        assert DispatchKey.Autograd not in op.py_kernels and op not in decompositions
        assert op not in select_decomp_table()
    assert op.py_kernels[DispatchKey.Autograd] is kernel and decompositions[op] is decomposition
    assert select_decomp_table()[op] is decomposition
