"""Graph utilities: finding nodes, subgraph checks and cloning, descendants, dumps, fake meta.

Everything here works on plain ``fx.Graph``/``fx.GraphModule`` (an ``IterGraph`` is one) and is
linear in the graph size: functions that need positions build one ``node -> index`` map
(:func:`node_order`) instead of scanning lists repeatedly.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from spmd_backend.errors import SpmdGraphError, SpmdUsageError
from spmd_backend.graph.aliasing import written

log = logging.getLogger(__name__)


def find_node(
    graph: fx.Graph, predicate: Callable[[fx.Node], bool], reverse_order: bool = False
) -> list[fx.Node]:
    """All nodes of ``graph`` for which ``predicate`` holds, in graph order (or reversed)."""
    nodes = reversed(graph.nodes) if reverse_order else graph.nodes
    return [n for n in nodes if predicate(n)]


def get_output(graph: fx.Graph) -> fx.Node:
    """The output node of ``graph`` (it is always the last node)."""
    for node in reversed(graph.nodes):
        if node.op == "output":
            return node
    raise SpmdGraphError("the graph has no output node")


def node_order(graph: fx.Graph) -> dict[fx.Node, int]:
    """``node -> position`` for every node: build once, then compare positions in O(1)."""
    return {n: i for i, n in enumerate(graph.nodes)}


def node_inputs(node: fx.Node) -> list[fx.Node]:
    """The nodes ``node`` reads (args and kwargs, flattened), in order, without duplicates."""
    seen: dict[fx.Node, None] = {}
    for a in pytree.tree_leaves((node.args, node.kwargs)):
        if isinstance(a, fx.Node):
            seen.setdefault(a, None)
    return list(seen)


def viewed_placeholder(node: object) -> fx.Node | None:
    """The placeholder ``node`` is, or is a view of (through aten view ops), else None."""
    for _ in range(16):
        if not isinstance(node, fx.Node):
            return None
        if node.op == "placeholder":
            return node
        target = node.target
        if node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and target.is_view:
            node = node.args[0]
            continue
        return None
    return None


def mutated_placeholders(node: fx.Node) -> list[fx.Node]:
    """Placeholders ``node`` writes in place (``copy_`` destinations, mutable schema args),
    directly or through a view."""
    return [base for base in map(viewed_placeholder, written(node)) if base is not None]


def is_leaf_subgraph(graph: fx.Graph, subgraph: Sequence[fx.Node]) -> bool:
    """True when every user of every node of ``subgraph`` is in ``subgraph`` or is the output.

    Nodes without users (side effects such as ``copy_``) are allowed: such a subgraph can be
    moved or cloned without rewiring anything outside it.
    """
    members = set(subgraph)
    for node in subgraph:
        for user in node.users:
            if user not in members and user.op != "output":
                return False
    return True


def find_all_descendants(graph: fx.Graph, parents: Iterable[fx.Node]) -> list[fx.Node]:
    """``parents`` and every node that (transitively) uses them, in graph order, no output."""
    seen: set[fx.Node] = set()
    queue: deque[fx.Node] = deque(parents)
    while queue:
        node = queue.popleft()
        if node in seen or node.op == "output":
            continue
        seen.add(node)
        queue.extend(node.users)
    order = node_order(graph)
    return sorted(seen, key=order.__getitem__)


def add_exclusive_inputs(
    graph: fx.Graph, nodes: Iterable[fx.Node], allow: Callable[[fx.Node], bool]
) -> list[fx.Node]:
    """``nodes`` plus every node ``allow`` accepts whose users all lie in the growing set.

    Used to complete a block with the work that exists only to feed it (for example the
    ``momentum * buf`` of an SGD update, which does not depend on the gradient and so is not
    among its descendants). Returned in graph order.
    """
    block = set(nodes)
    stack = list(block)
    while stack:
        node = stack.pop()
        for inp in node_inputs(node):
            if inp in block or inp.op in ("placeholder", "get_attr", "output") or not allow(inp):
                continue
            if all(u in block for u in inp.users):
                block.add(inp)
                stack.append(inp)
    order = node_order(graph)
    return sorted(block, key=order.__getitem__)


def clone_subgraph(
    graph: fx.Graph,
    subgraph: Sequence[fx.Node],
    target: fx.Node,
    arg_map: Mapping[fx.Node, fx.Node] | None = None,
) -> list[fx.Node]:
    """Copy ``subgraph`` (in graph order) before ``target``; returns the copies, in order.

    Inputs from outside the subgraph are kept (or replaced through ``arg_map``); inputs from
    inside it are rewired to the copies. Metadata is copied (annotations included).
    """
    order = node_order(graph)
    members = sorted(set(subgraph), key=order.__getitem__)
    val_map: dict[fx.Node, fx.Node] = dict(arg_map or {})
    clones: list[fx.Node] = []
    with graph.inserting_before(target):
        for node in members:
            if node.op in ("placeholder", "output"):
                raise SpmdGraphError(f"clone_subgraph: cannot clone {node.op} node {node.name}")
            new = graph.node_copy(node, lambda n: val_map.get(n, n))
            val_map[node] = new
            clones.append(new)
    return clones


def dump_graphs_to_files(
    graphs: Mapping[str, fx.GraphModule | fx.Graph], folder: str = ""
) -> str:
    """Write each graph's code to ``<folder>/<name>.graph``; returns the folder.

    With no folder a new temporary one is created; a given folder is created if needed and
    reused. The files are plain text (generated Python), never executed or unpickled.
    """
    if not folder:
        folder = tempfile.mkdtemp(prefix="spmd_graphs_")
    try:
        os.makedirs(folder, exist_ok=True)
        for name, g in graphs.items():
            if isinstance(g, fx.GraphModule):
                text = g.code if hasattr(g, "_code") else g.graph.python_code("self").src
            else:
                text = g.python_code("self").src
            safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
            with open(os.path.join(folder, f"{safe}.graph"), "w", encoding="utf-8") as f:
                f.write(text)
    except OSError as e:
        raise SpmdUsageError(f"cannot write graph dumps to {folder!r}: {e}") from e
    log.info("dumped %d graph(s) to %s", len(graphs), folder)
    return folder


def make_graph_module(root: torch.nn.Module | dict, graph: fx.Graph) -> fx.GraphModule:
    """A GraphModule whose Python code is generated lazily (on first call or ``.code``).

    Generating code is the largest fixed cost of editing big graphs; passes that only edit the
    graph never need it. Uses torch's ``_LazyGraphModule`` (private, pinned torch 2.13).
    """
    from torch.fx._lazy_graph_module import _LazyGraphModule

    return _LazyGraphModule(root, graph)


def lazy_graph_modules() -> object:
    """Context manager: GraphModules created inside (make_fx's included) generate code lazily."""
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    return _use_lazy_graph_module(True)


def emit_graph_artifact(name: str, graph: fx.Graph) -> None:
    """Emit ``graph`` as a torch structured-trace artifact (``TORCH_TRACE=dir``; tlparse shows
    it). Free when structured tracing is off: the code is generated only if a handler listens."""
    from torch._logging import trace_structured

    trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": name, "encoding": "string"},
        payload_fn=lambda: graph.python_code("self").src,
    )


def fake_mode_of(graph: fx.Graph) -> object | None:
    """The FakeTensorMode of the graph's ``meta['val']`` tensors (None when there is none)."""
    for node in graph.nodes:
        val = node.meta.get("val")
        for leaf in pytree.tree_leaves(val):
            mode = getattr(leaf, "fake_mode", None)
            if mode is not None:
                return mode
    return None


def propagate_val(node: fx.Node, fake_mode: object | None = None) -> None:
    """Compute ``node.meta['val']`` by running its op on its inputs' fake values."""
    if node.op != "call_function":
        return
    mode = fake_mode or fake_mode_of(node.graph)
    if mode is None:
        raise SpmdGraphError(f"propagate_val: no fake tensors in the graph of {node.name}")

    def val(a: object) -> object:
        if isinstance(a, fx.Node):
            if "val" not in a.meta:
                raise SpmdGraphError(f"propagate_val: input {a.name} of {node.name} has no meta['val']")
            return a.meta["val"]
        return a

    args, kwargs = pytree.tree_map(val, (node.args, node.kwargs))
    with mode:  # type: ignore[attr-defined]
        node.meta["val"] = node.target(*args, **kwargs)  # type: ignore[operator]



def tensor_nbytes(val: object) -> int:
    """Bytes of a (fake) tensor or of every tensor in a nested structure."""
    total = 0
    for leaf in pytree.tree_leaves(val):
        if isinstance(leaf, torch.Tensor):
            total += leaf.numel() * leaf.element_size()
    return total
