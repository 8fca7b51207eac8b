"""When the ranks switch a background-compiled graph to Inductor's code: agreed through the c10d
store, never with a collective.

A rank may build a graph its peers never build: Dynamo recompiles, and the compile door
retraces, on facts local to a rank (its last batch is smaller, its padded sequence length
changed). Meanwhile its peers run their own graph and wait in its collectives. Any collective
the switch protocol issued on such a graph (it used ``all_gather_object`` on the graph's second
call and a small ``all_reduce`` on each call until the switch) was paired by gloo/NCCL with one
of the peers' step collectives: the job hung (measured: the Dynamo door with Inductor, a 3-sample
last batch on one rank of two, hung until killed). Here the ranks talk through the store only,
reading what peers posted without blocking, so a graph no peer has just runs alone.

Ranks share a protocol when they run *the same* graph: the namespace is the graph's identity
(its code and its inputs' shapes, strides and dtypes, :func:`graph_identity`) and how many
graphs so named this process has started (``#1``, ``#2``). Graphs of different shapes on
different ranks (uneven batches) are different graphs: each rank switches when its own compile
is in (the graphs differ anyway; replicas stay equal to rounding).

Protocol of one graph (``ns`` = ``spmd/bg/<group>/<key>#<n>``), from its second call on:

1. each rank posts its :class:`Entry` (host and Inductor cache folder, its worker's status file)
   and waits at most :data:`ELECTION_WAIT_S` for the others' (ranks running the same graph reach
   that call together). When all are there, the lowest rank of each set with equal host, cache
   and worker key (:func:`~spmd_backend.lowering.handover.make_payload`) compiles and the others
   load its result (one worker per host); otherwise this rank compiles on its own;
2. once its compile is in (or failed), a rank posts the graph call on which it was ready (or
   that it failed), once;
3. every call reads the posts: any failure keeps every rank on the fx graph; when all ranks are
   ready, they switch on the call after the last one became ready. The last rank posted during
   that call, before the graph's collectives, which every rank had to reach before starting
   its next call: every rank sees every post by then and switches on the same call.

A rank that is alone (no process group, one rank, the fake backend, or peers that did not post
their entries in time) switches as soon as it is ready; it still posts, so a peer
that did see it in step 1 is not left waiting.

Guarantees: no collective, no unbounded wait (step 1 waits at most :data:`ELECTION_WAIT_S`, and
only while ranks running the same graph would be arriving too), two store reads per call until
the decision (three on the call all ranks are ready).
"""

from __future__ import annotations

import collections
import datetime
import hashlib
import logging
import pickle
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx as fx

log = logging.getLogger(__name__)

#: seconds a rank waits on a graph's second call for the peers running the same graph
ELECTION_WAIT_S = 5.0

READY, FAILED = "ready", "failed"

#: (group, identity) -> graphs so named this process has started (the namespace's ``#n``)
_STARTED: collections.Counter[tuple[str, str]] = collections.Counter()


def graph_identity(gm: fx.GraphModule) -> str:
    """Equal on ranks that run the same graph: its code and its inputs' shapes, strides and
    dtypes (the code alone does not hold every shape)."""
    h = hashlib.sha256(gm.code.encode())
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            h.update(repr((tuple(val.shape), val.stride(), val.dtype)).encode())
        else:
            h.update(repr(type(val)).encode())
    return h.hexdigest()[:32]


@dataclass(frozen=True)
class Entry:
    """What a rank tells the others on a graph's second call."""

    #: host name and realpath of the Inductor cache folder: ranks equal in it and in ``key``
    #: share one worker
    where: str
    #: the key of what this rank's worker would compile (None: it compiles in its own process)
    key: str | None
    #: the status file this rank's worker writes last (the others may load its result)
    done_path: str
    #: this rank compiled the graph from the caches alone (a warm start)
    cached: bool


@dataclass(frozen=True)
class Election:
    """What step 1 decided for this rank."""

    #: the status file of the worker whose result this rank loads; None: this rank compiles
    leader: str | None
    #: every rank compiled from the caches: nobody needs a worker
    everyone_cached: bool


class SwitchAgreement:
    """One graph's agreement on one rank; see the module docstring."""

    def __init__(self, group_name: str | None, identity: str | None) -> None:
        self._store: dist.Store | None = None
        self._ns = ""
        self._rank, self._world = 0, 1
        self._shared = False
        self._posted = False
        self._own: tuple[str, int] | None = None  # (READY|FAILED, call)
        self._switch_at: int | None = None
        if group_name is None or identity is None or not dist.is_initialized():
            return
        pg = dist.distributed_c10d._resolve_process_group(group_name)
        if pg.size() == 1 or dist.get_backend(pg) == "fake":
            return
        from torch.distributed.distributed_c10d import _get_default_store

        _STARTED[(group_name, identity)] += 1
        self._store = _get_default_store()
        self._ns = f"spmd/bg/{group_name}/{identity}#{_STARTED[(group_name, identity)]}"
        self._rank, self._world = pg.rank(), pg.size()

    def _keys(self, kind: str) -> list[str]:
        return [f"{self._ns}/{kind}/{r}" for r in range(self._world)]

    def elect(self, mine: Entry, call: int, wait_s: float = ELECTION_WAIT_S) -> Election:
        """Post ``mine`` and read the others' (step 1, on graph call ``call``). When every rank
        compiled from the caches, they all switch on this call: a rank whose wait ran out is
        alone and switches on its own as soon as it is ready, which a cached rank is already."""
        alone = Election(None, mine.cached)
        if self._store is None:
            return alone
        keys = self._keys("entry")
        self._store.set(keys[self._rank], pickle.dumps(mine))
        try:
            self._store.wait(keys, datetime.timedelta(seconds=wait_s))
        except Exception:  # noqa: BLE001 - c10d raises RuntimeError/DistStoreError on timeout
            missing = [r for r, k in enumerate(keys) if not self._store.check([k])]
            log.info("background compile: rank(s) %s run another graph; this rank's graph "
                     "switches on its own", missing)
            return alone
        self._shared = True
        entries = [pickle.loads(v) for v in self._store.multi_get(keys)]  # noqa: S301
        leader = None
        if mine.key is not None:
            first = next(e for e in entries if (e.where, e.key) == (mine.where, mine.key))
            leader = None if first.done_path == mine.done_path else first.done_path
        everyone_cached = all(e.cached for e in entries)
        if everyone_cached:
            self._switch_at = call
        return Election(leader, everyone_cached)

    def post(self, state: str, call: int) -> None:
        """Record, once, that this rank became ready (``READY``) or failed on ``call``."""
        if self._own is not None:
            return
        self._own = (state, call)
        if self._store is None:
            return
        if state == FAILED:
            self._store.add(f"{self._ns}/failed", 1)
        else:  # the value first, then the count: a full count means every value is there
            self._store.set(self._keys("ready")[self._rank], str(call))
            self._store.add(f"{self._ns}/ready", 1)

    def verdict(self, call: int) -> str | None:
        """``READY`` (switch on this call), ``FAILED`` (stay on the fx graph) or None (not yet);
        the same on every rank that shares the graph."""
        if not self._shared:
            return None if self._own is None else self._own[0]
        assert self._store is not None
        if self._switch_at is None:
            if self._store.add(f"{self._ns}/failed", 0) > 0:
                return FAILED
            if self._store.add(f"{self._ns}/ready", 0) < self._world:
                return None
            calls = [int(v) for v in self._store.multi_get(self._keys("ready"))]
            self._switch_at = max(calls) + 1
        return READY if call >= self._switch_at else None


__all__ = [
    "ELECTION_WAIT_S", "FAILED", "READY", "Election", "Entry", "SwitchAgreement", "graph_identity",
]
