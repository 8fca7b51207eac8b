"""Keep a gradient bucket's inputs out of the bucket's memory where something else reads them.

The bucketing pass concatenates gradients into one buffer and all_reduces it. Inductor (torch
2.13) lowers ``cat`` by having each input's producer write straight into its slice of the
output, and lowers the functional ``all_reduce`` as a clone that its scheduler then reuses in
place: the all_reduce runs on the concatenation's own buffer. When an input's buffer is read
again after the collective, that reader sees the sum over the ranks instead of this rank's
value. BatchNorm's backward is one such case: Inductor computes the weight gradient as a
reduction that the input gradient also reads, and in a per-graph backward graph the input
gradient (an output of the graph) is computed after the bucket's all_reduce; the backward went
wrong silently (5.6e-3 off DDP after one SGD step, 2e-2 with AdamW; found by a bug hunt,
2026-11-28).

:func:`protect_bucket_inputs` copies such inputs before the ``cat`` that feeds a collective:
each input that is (a view of) one output of a multi-output op (whose other outputs Inductor may
compute from the same buffers) or that has readers besides the ``cat``. The copy (a product with
1.0: Inductor removes a ``clone`` as a no-op) is what gets written into the bucket, the original
keeps its own buffer; a small BatchNorm-sized copy. For lowering only, on the flat copy Inductor
compiles.

Requires: the collectives' tensor inputs reach the ``cat`` through views only (what the
bucketing pass builds). Guarantees: values are unchanged; returns how many inputs were copied.
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx

from spmd_backend.graph import meta, ops

log = logging.getLogger(__name__)


def _bucket_of(collective: fx.Node) -> fx.Node | None:
    """The ``cat`` a collective's first tensor input is a view of, if any."""
    node = collective.args[0] if collective.args else None
    if not isinstance(node, fx.Node):
        return None
    node = ops.view_root(node)
    if node.op == "call_function" and node.target in ops.CAT_TARGETS:
        return node
    return None


def _shares_buffers(node: fx.Node, bucket: fx.Node) -> bool:
    """Whether Inductor may let another kernel read ``node``'s buffer after it is written into
    ``bucket``: ``node``, or what it is a view of, has readers besides the way to the bucket, or
    it is one output of a multi-output op whose other outputs are used (BatchNorm's backward)."""
    reader = bucket
    while True:
        if any(user is not reader for user in node.users):
            return True
        if not ops.is_view(node) or not isinstance(node.args[0], fx.Node):
            break
        reader, node = node, node.args[0]
    if ops.is_getitem(node) and isinstance(node.args[0], fx.Node):
        return any(user is not node for user in node.args[0].users)
    return False


def protect_bucket_inputs(gm: fx.GraphModule) -> int:
    """Copy the bucket inputs another kernel may read after the collective (module docstring)."""
    copied = 0
    for collective in [n for n in gm.graph.nodes if ops.is_collective(n)]:
        bucket = _bucket_of(collective)
        if bucket is None:
            continue
        inputs = list(bucket.args[0])
        for k, node in enumerate(inputs):
            if not isinstance(node, fx.Node) or not _shares_buffers(node, bucket):
                continue
            with gm.graph.inserting_before(bucket):  # a clone would be removed as a no-op
                copy = gm.graph.call_function(torch.ops.aten.mul.Tensor, (node, 1.0))
            meta.inherit(copy, node)
            if "val" in node.meta:
                copy.meta["val"] = node.meta["val"]
            inputs[k] = copy
            copied += 1
        bucket.args = (inputs, *bucket.args[1:])
    if copied:
        gm.recompile()
        log.debug("protect_bucket_inputs: %d gradient(s) copied before their bucket", copied)
    return copied


__all__ = ["protect_bucket_inputs"]
