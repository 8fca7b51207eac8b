"""Insert one functional collective and its ``wait_tensor`` into a graph, annotated.

The one builder every expansion uses (:mod:`spmd_backend.parallel.data_parallel`,
:mod:`spmd_backend.parallel.shard_expansion`). Guarantees: both nodes carry the input's fake
value (callers whose collective changes the shape overwrite it) and the ``comm`` phase with the
owning module's FQN; a gradient collective records the parameters it carries.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from spmd_backend.graph.meta import BUCKET_PARAMS_KEY, Phase, annotate

c10d = torch.ops._c10d_functional


def add_collective(
    graph: fx.Graph,
    value: fx.Node,
    target: object,
    args: tuple,
    *,
    name: str,
    owner: str | None,
    params: list[str] | None = None,
    before: fx.Node | None = None,
) -> fx.Node:
    """Insert ``wait_tensor(target(value, *args))`` (after ``value``, or before ``before``);
    returns the wait. Both nodes get ``value``'s fake value and the ``comm`` phase; a gradient
    all_reduce also records the parameters it carries (``spmd_bucket_params``)."""
    where = graph.inserting_before(before) if before is not None else graph.inserting_after(value)
    with where:
        comm = graph.create_node("call_function", target, (value, *args), name=name)
    with graph.inserting_after(comm):
        wait = graph.create_node("call_function", c10d.wait_tensor.default, (comm,), name="wait_tensor")
    for node in (comm, wait):
        if "val" in value.meta:
            node.meta["val"] = value.meta["val"]
        annotate(node, fqn=owner, phase=Phase.COMM)
    if params is not None:
        comm.meta[BUCKET_PARAMS_KEY] = list(params)
    return wait
