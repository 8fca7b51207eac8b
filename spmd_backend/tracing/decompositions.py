"""torch 2.13 Python decompositions that compute a wrong value, kept out of every trace and
compile of a step.

``aten.multilabel_margin_loss_forward`` (``nn.MultiLabelMarginLoss``): torch's decomposition
stops the labels at the first ``-1`` when it gathers the target scores but still adds one hinge
term per padded slot (each scoring label 0 against every class), so with fewer labels than
classes, the loss's normal use, the value and its gradient are wrong (a loss of 3.14 where eager
gives 1.26; stock ``torch.compile`` too). It is registered twice: as the op's Python kernel at
the Autograd key, which runs under the Python dispatcher (AOTAutograd in the Dynamo door and in
Inductor's compile, the compile door's symbolic trace), and in Inductor's decomposition table
and the copy of it Inductor builds at a process's first compile (review 42: an Inductor compile
before the first spmd step had built that copy with the op, and the fix was bypassed).
``backend="spmd"`` trained such a model 1.5 off DDP, and an Inductor-lowered compile-door step
returned the wrong loss (hunt 41, 2026-11-28).

:func:`aten_kernels_kept` removes both registrations while it is active, so the op stays one
aten op with its derivative from ``derivatives.yaml`` (``multilabel_margin_loss_backward``),
and Inductor runs torch's own kernels for the pair. The forward's fake-tensor (meta) kernel is
separate and stays; the backward has none that takes symbolic sizes, so while the scope is
active fake tensors get its output's shape from :func:`_backward_shape` (a symbolic trace,
``dynamic_batch=True``, needs it; real tensors never reach it).

Requires: torch 2.13's ``OpOverload.py_kernels`` and ``torch._inductor.decomposition``
tables. Guarantees: re-entrant; the registrations are restored exactly when the outermost use
exits; nothing else changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch._C import DispatchKey

aten = torch.ops.aten

#: ops whose torch 2.13 decomposition computes a wrong value (see the module docstring)
WRONG_DECOMPOSITIONS: tuple[torch._ops.OpOverload, ...] = (
    aten.multilabel_margin_loss_forward.default,
)

#: for each op of :data:`WRONG_DECOMPOSITIONS`, its backward op that then needs a symbolic
#: fake-tensor rule
_BACKWARDS: dict[torch._ops.OpOverload, torch._ops.OpOverload] = {
    aten.multilabel_margin_loss_forward.default: aten.multilabel_margin_loss_backward.default,
}

_depth = [0]


def _backward_shape(grad_output: torch.Tensor, self: torch.Tensor, *args: Any) -> torch.Tensor:
    """``multilabel_margin_loss_backward``'s output for fake tensors: shaped like ``self``."""
    from torch._subclasses.fake_tensor import FakeTensor

    if not isinstance(self, FakeTensor):
        raise RuntimeError("spmd_backend: the fake-tensor rule of multilabel_margin_loss_backward "
                           "was given a real tensor")
    return self.new_empty(self.shape)


def _inductor_tables() -> list[dict[Any, Any]]:
    """Inductor's decomposition table and the copy ``select_decomp_table`` hands out (built
    once per process by ``fast_random_decomps``, a cached function: built here, before
    anything is removed, so that it holds what torch registered)."""
    from torch._inductor import decomposition

    return [decomposition.decompositions, decomposition.fast_random_decomps()]


@contextlib.contextmanager
def aten_kernels_kept() -> Iterator[None]:
    """Within: the ops of :data:`WRONG_DECOMPOSITIONS` are neither decomposed by the Python
    dispatcher nor by Inductor."""
    if _depth[0]:
        _depth[0] += 1
        try:
            yield
        finally:
            _depth[0] -= 1
        return
    from torch._decomp import decomposition_table

    tables = _inductor_tables()
    saved: list[tuple[torch._ops.OpOverload, Any, list[Any]]] = []
    added = [op for op in _BACKWARDS.values() if op not in decomposition_table]
    for op in WRONG_DECOMPOSITIONS:
        saved.append((op, op.py_kernels.pop(DispatchKey.Autograd, None),
                      [table.pop(op, None) for table in tables]))
        op._dispatch_cache.clear()
    for op in added:  # read by FakeTensorMode for symbolic sizes only
        decomposition_table[op] = _backward_shape
    _depth[0] = 1
    try:
        yield
    finally:
        _depth[0] = 0
        for op, kernel, decompositions in saved:
            if kernel is not None:
                op.py_kernels[DispatchKey.Autograd] = kernel
            for table, decomposition in zip(tables, decompositions):
                if decomposition is not None:
                    table[op] = decomposition
            op._dispatch_cache.clear()
        for op in added:
            decomposition_table.pop(op, None)


__all__ = ["WRONG_DECOMPOSITIONS", "aten_kernels_kept"]
