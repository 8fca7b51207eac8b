"""Optimizer analysis: the foreach/fused "list ops" of an optimizer step, grouped into blocks.

Analysis only (never mutates). A *list op* is a ``_foreach_*`` or ``_fused_*`` optimizer op
whose tensor-list arguments hold one element per parameter. List ops are grouped into an
:class:`OptimizerBlock` when they are connected through their elements: a list element produced
by another list op (through ``getitem`` and per-element ops such as a dtype cast), or the same
node appearing in both (the in-place form, where list elements are the state placeholders).

``block.optim.optim_node`` is the node that reads the gradients (a fused kernel, or the first
foreach op with a gradient list); ``optim_node.args[1]`` are the gradients for both, as the
upstream API promises. ``block.step.add_node`` is the step-count increment, if any.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from spmd_backend.graph import ops
from spmd_backend.graph.meta import Phase, get_phase
from spmd_backend.graph.ops import is_list_op, op_name
from spmd_backend.graph.utils import node_inputs, node_order

aten = torch.ops.aten


def list_args(node: fx.Node) -> list[tuple[int | str, list]]:
    """``(position or kwarg name, list)`` for every list argument of ``node``."""
    out: list[tuple[int | str, list]] = []
    for i, a in enumerate(node.args):
        if isinstance(a, (list, tuple)):
            out.append((i, list(a)))
    for k, a in node.kwargs.items():
        if isinstance(a, (list, tuple)):
            out.append((k, list(a)))
    return out


def list_length(node: fx.Node) -> int:
    """The number of per-parameter elements of a list op (0 when it has no list argument)."""
    lengths = [len(v) for _, v in list_args(node) if v]
    return max(lengths) if lengths else 0


def _root(element: object) -> fx.Node | None:
    """Where a list element comes from: the list op that produced it (through getitems and
    one-input per-element ops such as a dtype cast), or the first other node on that chain
    (typically a state placeholder, for in-place chains)."""
    node = element
    for _ in range(8):
        if not isinstance(node, fx.Node):
            return None
        if ops.is_getitem(node):
            src = node.args[0]
            if isinstance(src, fx.Node) and is_list_op(src):
                return src
            node = src  # getitem of a getitem (fused ops return a tuple of lists)
            continue
        inputs = node_inputs(node)
        if len(inputs) == 1 and get_phase(node) is Phase.OPTIMIZER and not is_list_op(node):
            node = inputs[0]
            continue
        return node
    return node if isinstance(node, fx.Node) else None


@dataclass(frozen=True)
class OptimNode:
    """The op that consumes the gradients."""

    optim_node: fx.Node


@dataclass(frozen=True)
class StepNode:
    """The step-count increment (``_foreach_add`` over the state steps), if present."""

    add_node: fx.Node | None


@dataclass(frozen=True)
class OptimizerBlock:
    """Connected list ops of one optimizer step over one set of parameters."""

    optim: OptimNode
    step: StepNode
    nodes: tuple[fx.Node, ...]  # every list op of the block, in graph order
    length: int

    @property
    def gradients(self) -> list[fx.Node]:
        return list(self.optim.optim_node.args[1])

    @property
    def kind(self) -> str:
        return op_name(self.optim.optim_node)


class _UnionFind:
    def __init__(self) -> None:
        self.parent: dict[fx.Node, fx.Node] = {}

    def find(self, x: fx.Node) -> fx.Node:
        self.parent.setdefault(x, x)
        while self.parent[x] is not x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a: fx.Node, b: fx.Node) -> None:
        self.parent[self.find(a)] = self.find(b)


def _reads_gradients(node: fx.Node) -> bool:
    """A list op whose second argument holds reduced gradients, directly or through one-input
    per-element ops (a sharded optimizer reads a clone of its rank's slice of them)."""
    if len(node.args) < 2 or not isinstance(node.args[1], (list, tuple)):
        return False
    return any(
        isinstance(g, fx.Node) and Phase.COMM in (get_phase(g), _root_phase(g))
        for g in node.args[1]
    ) or op_name(node).startswith("_fused_")


def _root_phase(element: fx.Node) -> Phase | None:
    root = _root(element)
    return get_phase(root) if root is not None else None


def get_optimizer_blocks(graph: fx.Graph) -> list[OptimizerBlock]:
    """Every optimizer block of ``graph`` (list ops in the optimizer phase), in graph order."""
    list_ops = [n for n in graph.nodes if is_list_op(n) and get_phase(n) in (Phase.OPTIMIZER, None)]
    if not list_ops:
        return []
    uf = _UnionFind()
    owner_of_root: dict[fx.Node, fx.Node] = {}
    list_op_set = set(list_ops)
    for n in list_ops:
        uf.find(n)
        for _, elems in list_args(n):
            for e in elems:
                root = _root(e)
                if root is None or root is n:
                    continue
                if root in list_op_set:
                    uf.union(n, root)
                elif root.op == "placeholder" or get_phase(root) is Phase.COMM:
                    # the same state (or gradient) element: same optimizer block
                    other = owner_of_root.setdefault(root, n)
                    if other is not n:
                        uf.union(n, other)
    groups: dict[fx.Node, list[fx.Node]] = {}
    for n in list_ops:
        groups.setdefault(uf.find(n), []).append(n)
    order = node_order(graph)
    blocks: list[OptimizerBlock] = []
    for members in groups.values():
        members.sort(key=order.__getitem__)
        optim = next((m for m in members if op_name(m).startswith("_fused_")), None)
        if optim is None:
            optim = next((m for m in members if _reads_gradients(m)), None)
        if optim is None:
            continue  # list ops that never see a gradient (pure bookkeeping)
        step = next(
            (
                m for m in members
                if op_name(m) in ("_foreach_add", "_foreach_add_")
                and m is not optim
                and all(isinstance(e, fx.Node) and _is_step_like(e) for e in m.args[0])
            ),
            None,
        )
        blocks.append(
            OptimizerBlock(
                optim=OptimNode(optim), step=StepNode(step), nodes=tuple(members),
                length=list_length(optim),
            )
        )
    blocks.sort(key=lambda b: order[b.optim.optim_node])
    return blocks


def _is_step_like(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() == 0


def get_all_fused_optimizer_blocks(gm: object, fused_op_name: str) -> list[OptimizerBlock]:
    """Blocks whose gradient consumer's op name starts with ``fused_op_name``.

    ``"_fused_adam"`` matches ``_fused_adam``/``_fused_adam_`` (and AdamW's ``_fused_adamw``);
    ``"_foreach"`` matches foreach optimizers.
    """
    graph = gm.graph  # type: ignore[attr-defined]
    return [b for b in get_optimizer_blocks(graph) if b.kind.startswith(fused_op_name)]
