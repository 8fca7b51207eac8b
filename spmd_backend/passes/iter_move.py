"""iter_move_grads_and_optimizers: run one bucket's all_reduce and optimizer update next iteration.

Requires: an IterGraphModule (``gm.graph.move_to_next_iter_before``), the optimizer in in-place
form (prerequisite ``remove_copy_from_optimizer``), and waits already scheduled
(``schedule_comm_wait`` must not run after this pass). Guarantees: the optimizer blocks that
read the bucket's gradients are split so one part reads exactly them; that part, the bucket's
collective (with its packing) and everything that exists only to feed them is moved to run in
the next iteration just before ``target_dest_node``. Each target may be given as a node, a node
name (the upstream API: ``"all_reduce_default_1"``, ``"relu"``) or a :class:`ModuleTarget`:
``ModuleTarget("layers.3")`` as the comm target is the bucket carrying a gradient of a parameter
of ``layers.3``; as the destination it is the first node that reads one of its parameters (the
start of its forward). A destination after the first use of the moved parameters is refused by
``move_to_next_iter_before`` with an error naming the parameter and the use.

::

    iteration i:      fwd ... bwd(bucket b grads) ... all_reduce_b ... opt_b ...
    after the move:   [all_reduce_b(i-1), opt_b(i-1)] fwd(first use of b's params) ... bwd ...
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch.fx as fx

from spmd_backend.errors import SpmdPassError
from spmd_backend.graph import ops
from spmd_backend.graph.comm import get_comm_block, reduced_values
from spmd_backend.graph.meta import Phase, bucket_params, get_fqn, get_input_kind, get_phase
from spmd_backend.graph.ops import is_list_op
from spmd_backend.graph.optim import get_optimizer_blocks
from spmd_backend.graph.optim_surgery import split_optimizer_block
from spmd_backend.graph.utils import (
    add_exclusive_inputs,
    find_all_descendants,
    mutated_placeholders,
    node_inputs,
    node_order,
)
from spmd_backend.pass_manager import declare_pass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModuleTarget:
    """A pass target named by module FQN instead of node name (see the module docstring)."""

    fqn: str

    def owns(self, name: str) -> bool:
        return self.fqn == "" or name == self.fqn or name.startswith(self.fqn + ".")


def _by_name(graph: fx.Graph, name: str, what: str) -> fx.Node:
    for node in graph.nodes:
        if node.name == name:
            return node
    raise SpmdPassError(f"iter_move_grads_and_optimizers: no node named {name!r} ({what})")


def resolve_comm(graph: fx.Graph, target: object) -> fx.Node:
    """The collective named by ``target`` (node, name or ModuleTarget)."""
    if isinstance(target, ModuleTarget):
        for node in graph.nodes:
            if ops.is_all_reduce(node) and any(target.owns(p) for p in bucket_params(node)):
                return node
        raise SpmdPassError(
            f"iter_move_grads_and_optimizers: no gradient collective carries a parameter of "
            f"module {target.fqn!r}"
        )
    node = _by_name(graph, target, "comm target") if isinstance(target, str) else target
    if not isinstance(node, fx.Node) or not ops.is_collective(node):
        name = getattr(node, "name", node)
        raise SpmdPassError(f"iter_move_grads_and_optimizers: {name} is not a collective")
    return node


def resolve_dest(graph: fx.Graph, target: object) -> fx.Node:
    """The destination node named by ``target`` (node, name or ModuleTarget)."""
    if isinstance(target, ModuleTarget):
        order = node_order(graph)
        params = [
            n for n in graph.nodes
            if n.op == "placeholder" and get_input_kind(n) == "param" and target.owns(get_fqn(n) or "")
        ]
        users = [u for p in params for u in p.users]
        if not users:
            raise SpmdPassError(
                f"iter_move_grads_and_optimizers: module {target.fqn!r} has no parameter used "
                "in the graph"
            )
        return min(users, key=order.__getitem__)
    node = _by_name(graph, target, "destination") if isinstance(target, str) else target
    if not isinstance(node, fx.Node):
        raise SpmdPassError(f"iter_move_grads_and_optimizers: bad destination {target!r}")
    return node


def nodes_to_move(gm: object, comm: fx.Node) -> list[fx.Node]:
    """The bucket's collective and its (split-off) optimizer update, ready to move."""
    graph: fx.Graph = gm.graph  # type: ignore[attr-defined]
    block = get_comm_block(comm)
    grads = set(reduced_values(block))  # with reduce_op="avg": the scaled gradients
    roots: list[fx.Node] = [*block.pre_nodes, comm]
    for ob in get_optimizer_blocks(graph):
        if not grads & set(ob.gradients):
            continue
        if not set(ob.gradients) <= grads:
            ob, _ = split_optimizer_block(gm, ob, grads)
        roots.extend(ob.nodes)
    is_opt = lambda n: get_phase(n) is Phase.OPTIMIZER  # noqa: E731
    block = add_exclusive_inputs(graph, find_all_descendants(graph, roots), is_opt)
    # In-place updates carry no data edge to one another (``buf.mul_(m)`` before
    # ``buf.add_(g)``, then ``p.add_(buf)``): add every optimizer op that reads or writes state
    # the block writes. List ops were split above; one that still spans other parameters' state
    # is left out (the move's safety check then names the conflict).
    while True:
        members = set(block)
        written = {p for n in block for p in mutated_placeholders(n)}
        extra = []
        for n in graph.nodes:
            if n in members or not is_opt(n):
                continue
            writes = set(mutated_placeholders(n))
            reads = {p for p in node_inputs(n) if p.op == "placeholder"}
            if not (writes | reads) & written:
                continue
            if is_list_op(n) and not writes <= written:
                continue
            extra.append(n)
        if not extra:
            return block
        block = add_exclusive_inputs(graph, [*block, *extra], is_opt)


def iter_move_grads_and_optimizers(gm: object, target_comm_node: object, target_dest_node: object) -> None:
    """Move one bucket's all_reduce and optimizer update to the next iteration."""
    graph: fx.Graph = gm.graph  # type: ignore[attr-defined]
    if not hasattr(graph, "move_to_next_iter_before"):
        raise SpmdPassError(
            "iter_move_grads_and_optimizers needs an IterGraphModule (wrap the graph with "
            "spmd_backend.iter_graph_module.IterGraphModule)"
        )
    comm = resolve_comm(graph, target_comm_node)
    dest = resolve_dest(graph, target_dest_node)
    nodes = nodes_to_move(gm, comm)
    graph.move_to_next_iter_before(nodes, dest)  # type: ignore[attr-defined]
    log.info(
        "iter_move_grads_and_optimizers: %d node(s) of %s moved before %s",
        len(nodes), comm.name, dest.name,
    )


declare_pass(
    iter_move_grads_and_optimizers,
    prerequisites=["remove_copy_from_optimizer"],
    apply_after=["schedule_comm_wait"],
)
