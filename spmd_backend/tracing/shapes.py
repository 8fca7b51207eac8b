"""Symbolic argument dims: tracing them, and the shape guards a traced graph then depends on.

A dim marked dynamic (``compile(dynamic_batch=True)``, :func:`~spmd_backend.tracing.binding.
mark_dynamic`) is traced with a symbolic size, so one graph serves other sizes. The model may
still constrain it: ``view(4, 16, 128)`` specialises the size to 4, a reshape into pairs guards
it even. :meth:`SymbolicInputs.guard` collects those constraints from the trace's ``ShapeEnv``
as one compiled Python expression (:class:`ShapeGuard`) that the cache checks before reusing the
graph for a call, and logs every dim the model specialised, with where, so the user knows why a
ragged batch retraces instead of reusing (or worse, crashing in) the graph.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from spmd_backend.tracing.binding import StepBinding

log = logging.getLogger(__name__)


@dataclass
class ShapeGuard:
    """The shape constraints of a graph traced with symbolic dims, checked on every reuse."""

    code: Any  # compiled expression over L["t0"], L["t1"], ... (the dynamic arguments)
    source: str  # the same with the arguments' paths
    arg_leaves: tuple[int, ...]

    def holds(self, binding: StepBinding) -> bool:
        from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

        values = {f"t{i}": binding.flat_args[j] for i, j in enumerate(self.arg_leaves)}
        return bool(eval(self.code, SYMPY_INTERP, {"L": values}))

    def describe(self) -> str:
        return f"the cached graph's shape guards do not hold ({self.source})"


@dataclass
class SymbolicInputs:
    """Fake inputs for a trace with symbolic argument dims, and the mode that owns them."""

    fake_mode: Any
    fake_inputs: list[torch.Tensor]
    #: (flat argument leaf, fake input, symbolic dims)
    dynamic: list[tuple[int, torch.Tensor, set[int]]]
    #: (flat argument leaf, dim) -> the symbol its size was traced as
    symbols: dict[tuple[int, int], Any]

    def guard(self, binding: StepBinding) -> ShapeGuard | None:
        """The guards the trace left on the dynamic dims (None when there are none); logs the
        dims the model specialised to one size."""
        shape_env = self.fake_mode.shape_env
        paths = binding.arg_paths()
        for (j, d), symbol in self.symbols.items():
            expr = shape_env.replace(symbol)
            if expr.is_number:
                where = shape_env.spmd_fixed_at.get(symbol)
                log.warning(
                    "spmd_backend: dim %d of %s was marked dynamic, but the step specialised it "
                    "to %d%s; this graph serves only that size (other sizes retrace)",
                    d, paths[j], int(expr), f" at {where}" if where else "",
                )
        fakes = [fake for _, fake, _ in self.dynamic]
        # ignore_static=False: a dim specialised to a constant must be guarded here
        source = shape_env.produce_guards_expression(fakes, ignore_static=False)
        if not source:
            return None
        leaves = tuple(j for j, _, _ in self.dynamic)
        readable = source
        for i, j in enumerate(leaves):
            readable = readable.replace(f"L['t{i}']", paths[j])
        return ShapeGuard(
            code=compile(source, "<spmd_backend shape guards>", "eval"), source=readable,
            arg_leaves=leaves,
        )


def _recording_shape_env() -> Any:
    """A ShapeEnv that remembers the user-level line where a symbol was fixed to a constant
    (its own source locations point into torch under make_fx)."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from spmd_backend.tracing.errors import user_frame

    class RecordingShapeEnv(ShapeEnv):
        def _set_replacement(self, a: Any, tgt: Any, msg: str) -> None:
            if getattr(tgt, "is_number", False) and a not in self.spmd_fixed_at:
                self.spmd_fixed_at[a] = user_frame(traceback.extract_stack())
            super()._set_replacement(a, tgt, msg)

    env = RecordingShapeEnv()
    env.spmd_fixed_at = {}
    return env


def symbolic_inputs(
    binding: StepBinding, layout: Any, real_inputs: Sequence[torch.Tensor]
) -> SymbolicInputs | None:
    """Fake inputs with symbolic dims where arguments are marked dynamic (None: none are)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    arg_dims = [binding.dims_traced_dynamic(j) for j in layout.arg_inputs]
    if not any(arg_dims):
        return None
    mode = FakeTensorMode(shape_env=_recording_shape_env())
    n_state = layout.n_inputs - len(layout.arg_inputs)
    fakes = [mode.from_tensor(t.detach(), static_shapes=True) for t in real_inputs[:n_state]]
    dynamic: list[tuple[int, torch.Tensor, set[int]]] = []
    symbols: dict[tuple[int, int], Any] = {}
    for t, dims, j in zip(real_inputs[n_state:], arg_dims, layout.arg_inputs):
        if dims:
            context = StatelessSymbolicContext(
                dynamic_sizes=[DimDynamic.DYNAMIC if i in dims else DimDynamic.STATIC
                               for i in range(t.dim())]
            )
            fake = mode.from_tensor(t.detach(), symbolic_context=context)
            dynamic.append((j, fake, dims))
            symbols.update({(j, d): fake.shape[d].node.expr for d in dims})
        else:
            fake = mode.from_tensor(t.detach(), static_shapes=True)
        fakes.append(fake)
    return SymbolicInputs(fake_mode=mode, fake_inputs=fakes, dynamic=dynamic, symbols=symbols)
