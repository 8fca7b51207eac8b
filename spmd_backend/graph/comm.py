"""Communication analysis: collectives with their waits, inputs and consumers.

Analysis only (never mutates). A :class:`CommBlock` is one collective, the ``wait_tensor`` that
completes it, the nodes that prepare its input (flatten/cat made by bucketing) and the tail that
unpacks its output (split/getitem/view made by bucketing); ``outputs`` are the tail nodes whose
users lie outside the block (what the rest of the graph consumes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from spmd_backend.errors import SpmdGraphError
from spmd_backend.graph import ops
from spmd_backend.graph.meta import Phase, get_phase
from spmd_backend.graph.utils import node_inputs, node_order, tensor_nbytes

aten = torch.ops.aten

#: DDP's default gradient bucket cap (MiB); the one place the backend writes it
DEFAULT_BUCKET_SIZE_MB = 25.0

#: casts and the pre-division of a compressed gradient collective (DDP's compression hooks)
COMPRESSION_TARGETS = frozenset(
    {torch.ops.prims.convert_element_type.default, aten.div.Tensor}
)

#: ops that only repackage a collective's input or output (bucketing's flatten/cat/split/view,
#: compression's casts)
PACKING_TARGETS = frozenset(
    {
        aten.view.default,
        aten.reshape.default,
        aten.cat.default,
        aten.split_with_sizes.default,
        aten.clone.default,
        *COMPRESSION_TARGETS,
    }
)


@dataclass(frozen=True)
class Compression:
    """A gradient all_reduce done in a lower precision, as DDP's ``bf16_compress_hook`` and
    ``fp16_compress_hook`` do: cast to ``dtype``, divide by ``divisor`` (the world size, for a
    mean; ``None`` for a sum), all_reduce with ``sum``, cast back."""

    dtype: torch.dtype
    divisor: int | None


def _is_packing(node: fx.Node) -> bool:
    """A repackaging op made for communication (bucketing marks its nodes with phase comm);
    a gradient's own producer (say a ``view`` in the backward) is not packing."""
    return (
        node.op == "call_function"
        and (node.target in PACKING_TARGETS or ops.is_getitem(node))
        and get_phase(node) is Phase.COMM
    )


@dataclass(frozen=True)
class CommBlock:
    """A collective and everything that exists only to feed or unpack it."""

    comm_node: fx.Node
    wait_node: fx.Node
    pre_nodes: tuple[fx.Node, ...]  # input packing, in graph order (may be empty)
    tail_nodes: tuple[fx.Node, ...]  # output unpacking after the wait, in graph order
    inputs: tuple[fx.Node, ...]  # what the block reads from outside (e.g. the gradients)
    outputs: tuple[fx.Node, ...]  # block nodes read from outside (wait or tail views)
    group: str
    reduce_op: str | None
    nbytes: int

    @property
    def node_list(self) -> list[fx.Node]:
        return [*self.pre_nodes, self.comm_node, self.wait_node, *self.tail_nodes]

    @property
    def unfused(self) -> bool:
        """One gradient's collective as the expansion made it (at most compression casts
        around it; no bucketing flatten/cat/split)."""
        extra = [*self.pre_nodes, *self.tail_nodes]
        return all(n.target in COMPRESSION_TARGETS for n in extra) and len(self.inputs) == 1


def _reduce_op(node: fx.Node) -> str | None:
    if ops.is_all_reduce(node):
        return str(node.args[1])
    return None


def get_comm_block(comm_node: fx.Node) -> CommBlock:
    """The :class:`CommBlock` of ``comm_node`` (a functional collective)."""
    if not ops.is_collective(comm_node):
        raise SpmdGraphError(f"{comm_node.name} is not a collective")
    waits = [u for u in comm_node.users if ops.is_wait(u)]
    if len(waits) != 1:
        raise SpmdGraphError(f"collective {comm_node.name} has {len(waits)} waits, expected 1")
    wait = waits[0]

    # input packing: walk back through packing ops used only on the way to this collective
    pre: list[fx.Node] = []
    frontier = [a for a in node_inputs(comm_node)]
    inputs: list[fx.Node] = []
    members = {comm_node}
    while frontier:
        n = frontier.pop()
        if _is_packing(n) and all(u in members for u in n.users):
            pre.append(n)
            members.add(n)
            frontier.extend(node_inputs(n))
        elif n not in inputs:
            inputs.append(n)

    # output unpacking: split/getitem/view chains hanging off the wait
    tail: list[fx.Node] = []
    outputs: list[fx.Node] = []
    stack = [wait]
    while stack:
        n = stack.pop()
        external = False
        for u in n.users:
            if _is_packing(u) and u.target is not aten.cat.default and all(
                a is n or not isinstance(a, fx.Node) for a in node_inputs(u)
            ):
                tail.append(u)
                stack.append(u)
            else:
                external = True
        if external:
            outputs.append(n)

    order = node_order(comm_node.graph)
    pre.sort(key=order.__getitem__)
    tail.sort(key=order.__getitem__)
    outputs.sort(key=order.__getitem__)
    inputs.sort(key=order.__getitem__)
    group = str(comm_node.args[-1])
    return CommBlock(
        comm_node=comm_node,
        wait_node=wait,
        pre_nodes=tuple(pre),
        tail_nodes=tuple(tail),
        inputs=tuple(inputs),
        outputs=tuple(outputs),
        group=group,
        reduce_op=_reduce_op(comm_node),
        nbytes=tensor_nbytes(comm_node.args[0].meta.get("val")) if isinstance(comm_node.args[0], fx.Node) else 0,
    )


def reduced_values(block: CommBlock) -> list[fx.Node]:
    """What readers take as the block's results: each output, and where the expansion took
    DDP's mean after the sum (``reduce_op="avg"``, ``parallel.data_parallel._postscale``) the
    ``output * (1 / world)`` the optimizer reads instead."""
    found = list(block.outputs)
    for out in block.outputs:
        found += [
            u for u in out.users
            if u.target is torch.ops.aten.mul.Tensor and u.args[0] is out
            and not isinstance(u.args[1], fx.Node) and get_phase(u) is Phase.COMM
        ]
    return found


def get_all_comm_blocks(graph: fx.Graph, predicate=ops.is_all_reduce) -> list[CommBlock]:
    """Every collective matching ``predicate`` as a :class:`CommBlock`, in graph order."""
    return [get_comm_block(n) for n in graph.nodes if predicate(n)]
