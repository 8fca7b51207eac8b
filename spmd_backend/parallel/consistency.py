"""Cross-rank consistency of compiled graphs, checked through the c10d store (never a collective).

Before a new graph runs its first collective, every rank posts a signature of it under a key
that all ranks derive the same way (compiled-step index, trace number) and waits, with a
timeout, for every other rank's. A signature lists what ranks must agree on for their
collectives to match: the state inputs (parameters, buffers, optimizer state, with shapes and
dtypes) and every collective in order (op, reduce op, group, payload shape and dtype, the
parameters of its bucket). Activation shapes and the compute between collectives are not part
of it, so ranks may use different batch sizes, as with DDP. A mismatch
raises :class:`~spmd_backend.errors.SpmdDistributedError` on every rank, naming the first
differing node; a rank whose trace failed posts that instead (:func:`post_failure`), and the
others raise at once naming its error; a rank that never posts (it died, or did not trace at
this step) makes the others fail after the timeout instead of hanging in a collective.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging

import torch
import torch.distributed as dist
import torch.fx as fx

from spmd_backend.errors import SpmdDistributedError
from spmd_backend.graph import ops
from spmd_backend.graph.meta import bucket_params, get_input_kind

log = logging.getLogger(__name__)

#: seconds a rank waits for the others' graph signatures
DEFAULT_TIMEOUT_S = 300.0


def graph_signature(graph: fx.Graph) -> list[str]:
    """The lines ranks must agree on: state inputs and the collective schedule."""
    lines = []
    for node in graph.nodes:
        val = node.meta.get("val")
        spec = f"{list(val.shape)}:{val.dtype}" if isinstance(val, torch.Tensor) else "?"
        if node.op == "placeholder" and get_input_kind(node) not in ("arg", None):
            lines.append(f"input {node.name} {spec}")
        elif ops.is_collective(node):
            payload = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
            pspec = f"{list(payload.shape)}:{payload.dtype}" if isinstance(payload, torch.Tensor) else "?"
            extra = ",".join(repr(a) for a in node.args[1:])
            lines.append(
                f"collective {node.name} {node.target}({extra}) payload {pspec} "
                f"params {bucket_params(node)}"
            )
    return lines


def signature_digest(lines: list[str]) -> str:
    """A short identity of a signature (equal lines, equal digest)."""
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def default_store() -> dist.Store:
    """The default process group's store (the one every check of this module posts to)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def _post_key(group: dist.ProcessGroup, key: str, rank: int) -> str:
    """Where ``rank`` posts its lines for the check ``key`` (one namespace per process group)."""
    return f"spmd/{group.group_name}/{key}/{rank}"


def round_counter(group: dist.ProcessGroup, kind: str) -> str:
    """The store counter numbering this rank's checks of one ``kind`` on ``group`` (``store.add``
    it by 1 for the next round; a rank's rounds pair with the others' of the same number)."""
    return f"spmd/{group.group_name}/{kind}_rounds/{dist.get_rank(group)}"


def post_failure(key: str, group: dist.ProcessGroup, message: str) -> None:
    """Tell the ranks waiting in :func:`check_consistency` under ``key`` that this rank failed
    before it could post (its trace raised ``message``): they raise at once, naming it, instead
    of after their timeout. Does not wait; a no-op without peers."""
    if dist.get_world_size(group) == 1 or dist.get_backend(group) == "fake":
        return
    payload = json.dumps({"digest": "", "lines": [], "failed": message[:500]})
    default_store().set(_post_key(group, key, dist.get_rank(group)), payload)


def check_consistency(
    lines: list[str], key: str, group: dist.ProcessGroup, timeout_s: float = DEFAULT_TIMEOUT_S,
    what: str = "compiled graph", hint: str = "", missing_hint: str = "",
) -> str:
    """Post ``lines`` under ``key`` and compare with every rank of ``group``; returns the digest.
    ``what`` names what the lines describe in the error messages; ``hint`` ends those of a
    difference, ``missing_hint`` that of a rank that did not post."""
    digest = signature_digest(lines)
    world = dist.get_world_size(group)
    if world == 1 or dist.get_backend(group) == "fake":
        return digest  # nobody to disagree with (the fake backend has no real peers)
    rank = dist.get_rank(group)
    store = default_store()
    payload = json.dumps({"digest": digest, "lines": lines})
    keys = [_post_key(group, key, r) for r in range(world)]
    store.set(keys[rank], payload)
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except Exception:  # noqa: BLE001 - c10d raises RuntimeError/DistStoreError on timeout
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
    else:
        missing = []
    if missing:
        # withdrawn: a rank that arrives later must not take this post for agreement and run
        # a collective this rank will not join
        store.delete_key(keys[rank])
        raise SpmdDistributedError(
            f"spmd_backend: rank(s) {missing} did not publish their {what} ({key}) within "
            f"{timeout_s:.0f}s: "
            f"{missing_hint or 'they failed, or traced a different step'}; refusing to run a "
            "collective that could hang"
        )
    for r, k in enumerate(keys):
        if r == rank:
            continue
        other = json.loads(store.get(k))
        if other.get("failed"):
            raise SpmdDistributedError(
                f"spmd_backend: rank {r} failed while building its {what} ({key}), before any "
                f"collective of it: {other['failed']}. This rank stops here too; nothing it "
                "holds was changed"
            )
        if other["digest"] == digest:
            continue
        theirs = other["lines"]
        for a, b in zip(lines, theirs):
            if a != b:
                raise SpmdDistributedError(
                    f"spmd_backend: the {what} of rank {rank} differs from rank {r}'s "
                    f"({key}):\n  rank {rank}: {a}\n  rank {r}: {b}{hint}"
                )
        raise SpmdDistributedError(
            f"spmd_backend: the {what} of rank {rank} has {len(lines)} entries (state inputs, "
            f"collectives), rank {r}'s has {len(theirs)} ({key}){hint}"
        )
    log.debug("graph %s consistent across %d ranks (%s)", key, world, digest[:12])
    return digest
