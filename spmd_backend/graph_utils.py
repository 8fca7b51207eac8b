"""Seed-compatible face of :mod:`spmd_backend.graph.utils` (``torch.distributed._spmd.graph_utils``).

``find_node``, ``get_output``, ``dump_graphs_to_files``, ``is_leaf_subgraph`` and
``clone_subgraph`` with the upstream signatures; the op predicates live in
:mod:`spmd_backend.graph.ops` and are re-exported here.
"""

from spmd_backend.graph.ops import (
    is_all_reduce,
    is_broadcast,
    is_collective,
    is_copy_,
    is_foreach,
    is_fused_optimizer,
    is_wait,
)
from spmd_backend.graph.utils import (
    clone_subgraph,
    dump_graphs_to_files,
    find_node,
    get_output,
    is_leaf_subgraph,
)

__all__ = [
    "clone_subgraph",
    "dump_graphs_to_files",
    "find_node",
    "get_output",
    "is_leaf_subgraph",
    "is_all_reduce",
    "is_broadcast",
    "is_collective",
    "is_copy_",
    "is_foreach",
    "is_fused_optimizer",
    "is_wait",
]
