"""Scalar chains computed once per step, not once per vector: 0-dim optimizer math for Inductor.

An optimizer that is not one fused kernel (``torch.optim.Adam(...)`` as most users write it is
the single-tensor loop on the CPU; foreach Adam, RMSprop, Adagrad with decay, NAdam...) computes
its bias corrections on 0-dim tensors: ``beta ** step`` (in float64, see
:mod:`spmd_backend.tracing.bias_corrections`), a square root, a few divisions, and only then
meets the parameters. Inductor inlines 0-dim producers into the loop that reads them, and its
C++ backend evaluates the whole chain in the loop body: two ``std::pow``, a ``sqrt`` and the
divisions once per 8-element vector of every parameter. Measured on the seed MLP (5 x 2048,
2 gloo ranks): the Dynamo door's default-Adam update took 220 ms, against 44 ms for the same
update as one fused kernel.

:func:`materialize_scalar_chains` puts every 0-dim value that is computed from a scalar ``pow``
(:data:`~spmd_backend.graph.ops.SCALAR_POW_TARGETS`) and read by a non-scalar node behind
``spmd_backend::materialize``, a copy Inductor cannot see through: it computes the chain into a
buffer before the op, once, and the loop reads one number. The values waiting for a copy when
the first of them is read share one (one call per parameter for the single-tensor loop, one per
group for foreach). The fused optimizers' decomposition
(:mod:`spmd_backend.lowering.fused_decomp`) has its own opaque op for the same reason.

It runs as Inductor's post-grad pass (:data:`SCALAR_CHAIN_PASS`, installed by
:data:`~spmd_backend.lowering.inductor.STEP_GRAPH_CONFIG` for every step-graph compile, here and
in the compile worker): on AOTAutograd's functional graph, so a copy cannot miss an in-place
update of the value it copies, and inside Inductor's cache key (the pass's hash is this file's).

Requires ``meta["val"]`` (fake tensors) on the chain's nodes. Guarantees: values are unchanged
(each copy follows the values it copies; only readers that are not 0-dim read the copy); CPU
values only (on a GPU the chain is a few instructions of a memory-bound kernel, and each copy
would be one more launch); a graph without such a chain is unchanged.
"""

from __future__ import annotations

import logging
import operator

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from spmd_backend.graph.meta import inherit
from spmd_backend.graph.ops import SCALAR_POW_TARGETS

log = logging.getLogger(__name__)


@torch.library.custom_op("spmd_backend::materialize", mutates_args=())
def materialize(values: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``values`` (opaque to Inductor, so what computes them runs before it)."""
    return [v.clone() for v in values]


@materialize.register_fake
def _materialize_fake(values: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.empty_like(v) for v in values]


def _scalar(node: fx.Node) -> bool:
    """A 0-dim tensor value, or a list of them (a foreach op over per-parameter scalars)."""
    val = node.meta.get("val")
    if isinstance(val, (list, tuple)):
        return bool(val) and all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in val)
    return isinstance(val, torch.Tensor) and val.dim() == 0


def _on_cpu(node: fx.Node) -> bool:
    val = node.meta.get("val")
    first = val[0] if isinstance(val, (list, tuple)) else val
    return isinstance(first, torch.Tensor) and first.device.type == "cpu"


def _mutates(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and schema.is_mutable


def _readers(node: fx.Node) -> list[fx.Node]:
    """The nodes that read ``node`` into non-scalar math (where Inductor would inline it)."""
    return [u for u in node.users if u.op != "output" and not _scalar(u)]


def _copy_before(graph: fx.Graph, reader: fx.Node, values: list[fx.Node]) -> None:
    """One copy of ``values`` just before ``reader``; their non-scalar readers read the copies."""
    with graph.inserting_before(reader):
        flat: list[fx.Node] = []
        for v in values:
            val = v.meta["val"]
            if isinstance(val, (list, tuple)):
                for i, item in enumerate(val):
                    piece = inherit(graph.call_function(operator.getitem, (v, i)), v)
                    piece.meta["val"] = item
                    flat.append(piece)
            else:
                flat.append(v)
        copy = inherit(graph.call_function(torch.ops.spmd_backend.materialize.default, (flat,)),
                       values[0])
        copy.meta["val"] = [f.meta["val"] for f in flat]
        outs = []
        for i, f in enumerate(flat):
            out = inherit(graph.call_function(operator.getitem, (copy, i)), f)
            out.meta["val"] = f.meta["val"]
            outs.append(out)
    at = 0
    for v in values:
        val = v.meta["val"]
        n = len(val) if isinstance(val, (list, tuple)) else 1
        repl: fx.Node | list[fx.Node] = outs[at:at + n] if isinstance(val, (list, tuple)) else outs[at]
        at += n
        for u in _readers(v):
            u.args = fx.node.map_arg(u.args, lambda a, v=v, r=repl: r if a is v else a)
            u.kwargs = fx.node.map_arg(u.kwargs, lambda a, v=v, r=repl: r if a is v else a)


def materialize_scalar_chains(graph: fx.Graph) -> int:
    """Put each CPU scalar chain's results behind a copy (see the module docstring): the values
    pending when their first reader comes share one copy, placed just before that reader.
    Returns how many values were copied; the caller recompiles the graph module."""
    from_pow: set[fx.Node] = set()
    pending: dict[fx.Node, None] = {}  # values without a copy yet, in graph order
    copied = 0
    for node in list(graph.nodes):
        if pending and node.op != "output" and not _scalar(node) and any(
            a in pending for a in node.all_input_nodes
        ):
            _copy_before(graph, node, list(pending))
            copied += len(pending)
            pending.clear()
        if node.op != "call_function" or not _scalar(node):
            continue
        if node.target in SCALAR_POW_TARGETS or any(a in from_pow for a in node.all_input_nodes):
            from_pow.add(node)
            # a value something writes in place is left alone (not in a functional graph)
            if _on_cpu(node) and _readers(node) and not any(_mutates(u) for u in node.users):
                pending[node] = None
    if copied:
        log.debug("materialize_scalar_chains: %d scalar values computed once", copied)
    return copied


class MaterializeScalarChains(CustomGraphPass):
    """:func:`materialize_scalar_chains` as an Inductor post-grad pass (cache key: this file)."""

    def __call__(self, graph: fx.Graph) -> None:
        materialize_scalar_chains(graph)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))


#: the instance step-graph compiles install as ``post_grad_custom_pre_pass``
SCALAR_CHAIN_PASS = MaterializeScalarChains()

__all__ = ["SCALAR_CHAIN_PASS", "MaterializeScalarChains", "materialize", "materialize_scalar_chains"]
