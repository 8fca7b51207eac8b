"""iter_move_grads_and_optimizers: run one bucket's all_reduce and optimizer update next iteration.

Requires: an IterGraphModule (``gm.graph.move_to_next_iter_before``), the optimizer in in-place
form (prerequisite ``remove_copy_from_optimizer``), and waits already scheduled
(``schedule_comm_wait`` must not run after this pass). Guarantees: the optimizer blocks that
read the bucket's gradients are split so one part reads exactly them; that part, the bucket's
collective (with its packing) and everything that exists only to feed them is moved to run in
the next iteration just before ``target_dest_node``, with every later reader of a computed
tensor the moved update writes in place (sharded state: the all_gather of the updated slice,
which writes the parameter; one that also carries another bucket's parameters is refused).
Each target may be given as a node, a node
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

import torch
import torch.fx as fx

from spmd_backend.errors import SpmdPassError
from spmd_backend.graph import ops
from spmd_backend.graph.aliasing import alias_root, readers, written
from spmd_backend.graph.comm import get_comm_block, reduced_values
from spmd_backend.graph.meta import (
    Phase,
    bucket_params,
    get_fqn,
    get_input_kind,
    get_phase,
    param_name,
)
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
aten = torch.ops.aten


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
            gradient_collective = ops.is_all_reduce(node) or ops.is_reduce_scatter(node)
            if gradient_collective and any(target.owns(p) for p in bucket_params(node)):
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
    grads = _with_shards(reduced_values(block))  # with reduce_op="avg": the scaled gradients
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
        readers_after = _readers_after_intermediate_writes(graph, block)
        if readers_after:
            block = add_exclusive_inputs(
                graph, find_all_descendants(graph, [*block, *readers_after]), is_opt
            )
            continue
        written_inputs = {p for n in block for p in mutated_placeholders(n)}
        extra = []
        for n in graph.nodes:
            if n in members or not is_opt(n):
                continue
            writes = set(mutated_placeholders(n))
            reads = {p for p in node_inputs(n) if p.op == "placeholder"}
            if not (writes | reads) & written_inputs:
                continue
            if is_list_op(n) and not writes <= written_inputs:
                continue
            extra.append(n)
        if not extra:
            return block
        block = add_exclusive_inputs(graph, [*block, *extra], is_opt)


def _with_shards(values: list[fx.Node]) -> set[fx.Node]:
    """``values`` and the copies and views made of each alone (the flat view, this rank's
    slice and its clone that a sharded optimizer reads as the gradient)."""
    out: set[fx.Node] = set()
    queue = list(values)
    while queue:
        node = queue.pop()
        if node in out:
            continue
        out.add(node)
        queue.extend(u for u in node.users if node_inputs(u) == [node] and _moves_data(u))
    return out


def _moves_data(node: fx.Node) -> bool:
    target = node.target
    return node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and (
        target.is_view or target in (aten.clone.default, aten._to_copy.default)
    )


def _readers_after_intermediate_writes(graph: fx.Graph, block: list[fx.Node]) -> list[fx.Node]:
    """Ops outside ``block`` that read, after a block op wrote it in place, a tensor the graph
    computes (not an input): they must move with the write. Sharded optimizer state updates a
    clone of this rank's parameter slice in place and all_gathers that clone into the
    parameter; moving the update without the all_gather gathered the slice before its update
    and dropped the moved update (both ranks alike, silently, until 2026-11-28)."""
    order = node_order(graph)
    members = set(block)
    out: dict[fx.Node, None] = {}
    for node in block:
        for target in written(node):
            root = alias_root(target)
            if root.op == "placeholder":
                continue
            for reader in readers(root):
                if reader not in members and order[reader] > order[node]:
                    out.setdefault(reader, None)
    return list(out)


def _refuse_shared_gathers(comm: fx.Node, nodes: list[fx.Node]) -> None:
    """Sharded state: the moved all_gathers must carry only the moved bucket's parameters. One
    bucketed with a parameter of another gradient bucket would take that parameter's update
    along, before its gradient exists."""
    if not any(ops.is_all_gather(n) for n in nodes):
        return
    own = set(bucket_params(comm))
    gathered = {
        param_name(p) or p.name for n in nodes for p in mutated_placeholders(n)
        if get_input_kind(p) == "param"
    }
    others = sorted(gathered - own)
    if others:
        raise SpmdPassError(
            f"iter_move_grads_and_optimizers: with shard_optimizer, the all_gather of the "
            f"updated parameters of {comm.name} ({', '.join(sorted(own))}) also carries "
            f"{', '.join(others)}, whose gradients another collective reduces; move a bucket "
            "whose parameter all_gathers carry only its own parameters (bucket sizes that "
            "split the parameters alike, or no comm_fusion_with_concat)"
        )


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
    _refuse_shared_gathers(comm, nodes)
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
