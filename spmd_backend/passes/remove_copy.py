"""remove_copy_from_optimizer: turn the functional optimizer back into in-place updates.

Requires: a traced step graph (functional optimizer ops whose results are written back to the
parameter/state placeholders by ``copy_`` nodes at the end). Guarantees: every optimizer-phase
functional op (``_fused_adam``, ``_foreach_*``, single-tensor ``add``/``mul``/...) that has an
in-place variant is replaced by it, mutating its first argument(s) directly, when that is safe:

* each element it would mutate is read by nothing after it (except write-back copies), through
  any view of its storage, nor by a collective still in flight (issued before it, waited after
  it: ASGD's averaging once subtracted in place from the parameter shard its all_gather was
  still sending),
* the op reads no element it would mutate through another of its arguments, unless it works
  element by element and reads the very same tensor there (``mul(x, x)``, a foreach op's
  element i in its own list position): ``addmm(g, g, g)`` made ``addmm_`` overwrites ``g`` while
  its matrix product still reads it (Muon's Newton-Schulz iteration: NaN after one step),
* an element that is a graph input (placeholder) still has a write-back copy pending after it
  (which will store the input's final value), and
* each functional result has exactly the shape, dtype and strides of the element that would
  hold it (``div(step, denom)`` broadcasts a 0-dim step to the parameter's shape: writing it
  into the step in place would fail, or worse, change the step's dtype), and
* no element that is a graph input would be written by an op whose results feed an op that
  can still fail (:func:`spmd_backend.graph.commit.is_fallible`: a collective, a wait...), which
  must then run after the write. Such an update stays functional, and ``commit_writes_late``
  moves its write-backs below the last fallible op: with sharded optimizer state the update
  produces the shards that the all_gathers send, and made in place it wrote the state before
  their waits, which made the runtime snapshot all of that state on every call (80 MB and 8% of
  the step on the MLP with 2 ranks, docs/benchmarks.md); the functional update writes new
  buffers and the write-backs copy them once every collective has succeeded. (An in-place
  update that only happens to be placed before an independent collective is still made, as
  before: the runtime snapshots what it writes.)

uses of its results are redirected to the mutated elements (a write-back's own users, such as
the graph output AOTAutograd returns a mutated input through, get its destination: ``copy_``
returns it), and write-backs that became ``copy_(x, x)`` are removed. What ends up in the real parameters and optimizer state is
unchanged; the graph loses the extra allocations and copies, and each optimizer update becomes
a node that can be moved or split. A graph with no such pattern is a logged no-op.

::

    before:  out = _fused_adam(p, g, m, v, ...)   ...   copy_(p, out[0][i])  copy_(m, out[2][i])
    after:   _fused_adam_(p, g, m, v, ...)
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch
import torch.fx as fx

from spmd_backend.graph import ops
from spmd_backend.graph.aliasing import alias_root, read_end, readers
from spmd_backend.graph.commit import is_fallible
from spmd_backend.graph.meta import Phase, get_phase, inherit
from spmd_backend.graph.utils import node_order
from spmd_backend.pass_manager import declare_pass

log = logging.getLogger(__name__)
aten = torch.ops.aten


def inplace_variant(target: object) -> object | None:
    """``aten.foo_.ovl`` for ``aten.foo.ovl`` when it exists and mutates its first argument's
    data. A view op (``detach``, ``t``...: its result aliases its input) has none: its
    "in-place" form rewrites the input's metadata (``detach_`` of a bucket's view raises)."""
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
        return None
    if ops.is_view_target(target):
        return None
    packet = target._overloadpacket.__name__
    if packet.endswith("_"):
        return None
    inplace_packet = getattr(aten, packet + "_", None)
    if inplace_packet is None:
        return None
    ovl = getattr(inplace_packet, target._overloadname, None)
    if ovl is None:
        return None
    first = ovl._schema.arguments[0] if ovl._schema.arguments else None
    if first is None or first.alias_info is None or not first.alias_info.is_write:
        return None
    return ovl


def _mutations(node: fx.Node) -> list[tuple[fx.Node, list[fx.Node]]] | None:
    """``(element the in-place op would mutate, nodes holding the functional result)`` pairs."""
    n_lists = ops.FUSED_MUTATED_LISTS.get(node.target)
    if n_lists is not None:
        outs: dict[tuple[int, int], list[fx.Node]] = {}
        for u in node.users:
            if not ops.is_getitem(u):
                return None
            k = int(u.args[1])
            for v in u.users:
                if not ops.is_getitem(v):
                    return None
                outs.setdefault((k, int(v.args[1])), []).append(v)
        pairs = []
        for k in range(n_lists):
            for i, elem in enumerate(node.args[k]):
                pairs.append((elem, outs.get((k, i), [])))
        return pairs
    self_arg = node.args[0]
    if isinstance(self_arg, (list, tuple)):  # foreach: element i <-> getitem(node, i)
        outs_i: dict[int, list[fx.Node]] = {}
        for u in node.users:
            if not ops.is_getitem(u):
                return None
            outs_i.setdefault(int(u.args[1]), []).append(u)
        return [(elem, outs_i.get(i, [])) for i, elem in enumerate(self_arg)]
    if isinstance(self_arg, fx.Node):
        return [(self_arg, [node])]
    return None


def _same_layout(elem: fx.Node, results: list[fx.Node]) -> bool:
    """Every result has the mutated element's shape, dtype and strides (known fake values)."""
    dst = elem.meta.get("val")
    if not isinstance(dst, torch.Tensor):
        return False
    for r in results:
        val = r.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return False
        if val.shape != dst.shape or val.dtype != dst.dtype or val.stride() != dst.stride():
            return False
    return True


def _mutated_positions(node: fx.Node) -> int:
    """How many leading arguments the in-place variant writes (the fused kernels: several)."""
    return ops.FUSED_MUTATED_LISTS.get(node.target, 1)


def _elementwise(node: fx.Node) -> bool:
    """Whether each output element depends only on the same element of each input (a foreach
    or fused optimizer kernel: per tensor of its lists)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return (torch.Tag.pointwise in target.tags or target in ops.FUSED_MUTATED_LISTS
            or target._overloadpacket.__name__.startswith("_foreach_"))


def _leaves(args: object) -> list[tuple[fx.Node, int | None]]:
    """``(tensor, list position)`` for each node among ``args`` (position None: not in a list)."""
    out: list[tuple[fx.Node, int | None]] = []
    for arg in args:  # type: ignore[attr-defined]
        if isinstance(arg, fx.Node):
            out.append((arg, None))
        elif isinstance(arg, (list, tuple)):
            out.extend((e, i) for i, e in enumerate(arg) if isinstance(e, fx.Node))
    return out


def _reads_own_output(node: fx.Node) -> bool:
    """Whether ``node``, made in place, would read an element it writes as another argument
    (see the module docstring): allowed only for an element-wise op reading the same tensor,
    at the same list position for a list argument."""
    n_mutated = _mutated_positions(node)
    written = set(_leaves(node.args[:n_mutated]))
    roots = {alias_root(e) for e, _ in written}
    elementwise = _elementwise(node)
    return any(
        alias_root(e) in roots and not (elementwise and (e, i) in written)
        for e, i in _leaves((*node.args[n_mutated:], *node.kwargs.values()))
    )


def _safe(
    node: fx.Node,
    pairs: list[tuple[fx.Node, list[fx.Node]]],
    order: dict[fx.Node, int],
    feeds_fallible: set[fx.Node],
) -> bool:
    """Whether mutating each element in place at ``node`` keeps the graph's meaning, and its
    failure behaviour.

    An element's old value must be read by nothing after ``node``, through any view of its
    storage, and by no collective issued before ``node`` and waited after it (the process
    group reads its input until the wait: :mod:`spmd_backend.graph.aliasing`). A graph input may be
    clobbered only while a write-back ``copy_`` into it is still pending after ``node`` (that
    copy writes its final value); once an earlier rewrite made it hold its final value, it must
    not be touched again; and not by an op in ``feeds_fallible`` (whose results an op that can
    fail at run time reads: the input would be written before that op, and a failure would
    leave it half-written).
    """
    elems = [e for e, _ in pairs]
    if any(not isinstance(e, fx.Node) for e in elems) or len(set(elems)) != len(elems):
        return False
    if _reads_own_output(node):
        return False
    pos = order[node]
    for elem, results in pairs:
        if elem.op == "get_attr" or not _same_layout(elem, results):
            return False
        if elem.op == "placeholder" and node in feeds_fallible:
            return False
        root = alias_root(elem)
        if root is not elem and root.op in ("placeholder", "get_attr"):
            return False  # a view of a graph input: the write would reach the input itself
        pending_write_back = False
        for reader in readers(root):
            if reader is node or read_end(reader, order) < pos:
                continue
            if ops.is_copy_(reader) and reader.args[0] is elem and order[reader] > pos:
                pending_write_back = True
                continue
            return False
        if elem.op == "placeholder" and not pending_write_back:
            return False
    return True


def _feeding_fallible(graph: fx.Graph) -> set[fx.Node]:
    """Every node whose result an op that can fail at run time reads, directly or not."""
    feeds: set[fx.Node] = set()
    for node in reversed(graph.nodes):
        if any(is_fallible(u) or u in feeds for u in node.users):
            feeds.add(node)
    return feeds


def _candidates(graph: fx.Graph) -> Iterator[fx.Node]:
    for node in list(graph.nodes):
        if get_phase(node) is not Phase.OPTIMIZER or node.op != "call_function":
            continue
        if inplace_variant(node.target) is not None:
            yield node


def remove_copy_from_optimizer(gm: object) -> None:
    """Re-inplace the optimizer and drop its write-back copies (see the module docstring)."""
    graph: fx.Graph = gm.graph  # type: ignore[attr-defined]
    order = node_order(graph)
    feeds = _feeding_fallible(graph)
    rewritten = kept = 0
    for node in _candidates(graph):
        pairs = _mutations(node)
        if not pairs:
            continue
        if not _safe(node, pairs, order, feeds):
            kept += node in feeds and any(
                isinstance(e, fx.Node) and e.op == "placeholder" for e, _ in pairs)
            continue
        with graph.inserting_before(node):
            new = graph.call_function(inplace_variant(node.target), node.args, node.kwargs)
        inherit(new, node)
        if isinstance(node.args[0], fx.Node):
            new.meta["val"] = node.args[0].meta.get("val")
        order[new] = order[node]
        for elem, results in pairs:
            for r in results:
                for user in list(r.users):
                    if ops.is_copy_(user) and user.args[0] is elem:
                        user.replace_all_uses_with(elem)  # copy_ returns its destination
                        graph.erase_node(user)
                r.replace_all_uses_with(elem)
        for u in list(node.users):  # fused: the per-list getitems, now unused
            if not u.users:
                graph.erase_node(u)
        for _, results in pairs:
            for r in results:
                if r is not node and not r.users and r.graph is graph and not getattr(r, "_erased", False):
                    graph.erase_node(r)
        if not node.users:
            graph.erase_node(node)
        rewritten += 1
    removed = 0
    for node in list(graph.nodes):  # write-backs that became copy_(x, x)
        if ops.is_copy_(node) and node.args[0] is node.args[1] and not node.users:
            graph.erase_node(node)
            removed += 1
    if kept:
        log.info("remove_copy_from_optimizer: %d op(s) writing graph inputs before a collective "
                 "or another op that can fail stay functional", kept)
    if not rewritten:
        log.info("remove_copy_from_optimizer: no functional optimizer op to re-inplace")
    else:
        log.info(
            "remove_copy_from_optimizer: %d op(s) made in-place, %d self-copies removed",
            rewritten, removed,
        )


declare_pass(remove_copy_from_optimizer)
