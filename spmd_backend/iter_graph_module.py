"""IterGraphModule: a train-step module that can move work into the next iteration.

Requires an ``fx.GraphModule`` of one training iteration. Guarantees:

* ``igm.graph`` is the module's own graph adopted (not copied) as an
  :class:`~spmd_backend.graph.iter_graph.IterGraph`: an ordinary ``fx.Graph`` that also records
  :meth:`~spmd_backend.graph.iter_graph.IterGraph.move_to_next_iter_before` requests (the moves,
  their safety checks and the derivation sketch are documented there).
* The *setup*, *main* and *cleanup* graphs are derived from that one graph and its moves: before
  :meth:`IterGraphModule.finalize_setup` they are rebuilt on every access
  (``setup_gm``/``main_gm``/``cleanup_gm``), after it they are frozen and, when a ``lower``
  callable was given, lowered with it (each once; a graph without moves is one module for
  every kind of call).
* Calls: ``forward(*args, last_iter=False)``. The first call of a cycle runs setup (or, if it is
  also the last, the plain graph), later calls main, a ``last_iter=True`` call cleanup, after
  which the next call starts a new cycle. :meth:`flush` runs the pending work immediately (so a
  checkpoint taken mid-training loses nothing) and starts a new cycle. :attr:`pending_moves`
  tells how many moved blocks are pending. A call that raises changes none of the module's state.

Lowering is injected, not imported: ``lower`` is any callable that turns a derived
``fx.GraphModule`` into something called the same way (``spmd_backend.lowering.lower_to_inductor``
is what ``GraphModuleTransformation(enable_inductor=True)`` passes). The upstream keyword
``enable_inductor=True`` is kept as a shorthand for that same function, resolved when the module
is constructed; importing this module never imports the lowering.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from spmd_backend.errors import SpmdUsageError
from spmd_backend.graph.iter_graph import DerivedGraphs, IterGraph, IterMove, derive
from spmd_backend.graph.utils import make_graph_module

log = logging.getLogger(__name__)

#: compiles one derived graph module into a callable with the same calling convention
Lowering = Callable[[fx.GraphModule], Callable[..., Any]]

#: the derived graphs passes edit and calls run (flush is never lowered)
_STEP_KINDS = ("setup", "main", "cleanup")


def _resolve_lowering(enable_inductor: bool, lower: Lowering | None) -> Lowering | None:
    """The upstream keyword: ``enable_inductor=True`` means ``lower=lower_to_inductor``."""
    if not enable_inductor:
        return lower
    if lower is not None:
        raise SpmdUsageError("IterGraphModule: give enable_inductor=True or lower=..., not both")
    from spmd_backend.lowering import lower_to_inductor  # the compatibility path only

    return lower_to_inductor


# ----------------------------------------------------------------------------- the module
class IterGraphModule(nn.Module):
    """See the module docstring. ``max_iters > 0`` makes call number ``max_iters`` the last;
    ``lower`` (keyword) lowers the finalized graphs; ``enable_inductor`` is the upstream
    spelling of ``lower=spmd_backend.lowering.lower_to_inductor``."""

    def __init__(
        self,
        main_gm: fx.GraphModule,
        max_iters: int = -1,
        enable_inductor: bool = False,
        *,
        lower: Lowering | None = None,
        legalize: Callable[[fx.Graph], object] | None = None,
    ) -> None:
        super().__init__()
        self._source = main_gm
        #: applied to each derived graph before it becomes a module (what the process group
        #: backend needs of the graph, :mod:`spmd_backend.parallel.gloo_all_gather`)
        self.legalize = legalize
        self._graph = IterGraph.adopt(main_gm.graph)
        self.max_iters = max_iters
        self.lower = _resolve_lowering(enable_inductor, lower)
        self._finalized: DerivedGraphs | None = None
        self._modules_by_kind: dict[str, Any] = {}
        self._carried: list[Any] | None = None
        self._iter = 0
        self.cycles = 0

    # ------------------------------------------------------------------ graphs
    @property
    def graph(self) -> IterGraph:
        return self._graph

    @property
    def finalized(self) -> bool:
        return self._finalized is not None

    def iter_graphs(self) -> dict[str, fx.Graph]:
        """The graphs passes edit: the one IterGraph before finalize, the three after."""
        if self._finalized is None:
            return {"main": self._graph}
        kinds = dict.fromkeys(self._shared_kind(k) for k in _STEP_KINDS)  # each graph once
        return {
            "main" if k == "plain" else k: self._gm(k).graph
            for k in kinds if isinstance(self._gm(k), fx.GraphModule)
        }

    def source_graphs(self) -> dict[str, fx.Graph]:
        """The fx graphs each kind of call runs (before lowering): the one IterGraph before
        finalize, setup/main/cleanup after."""
        if self._finalized is None:
            return {"main": self._graph}
        return {k: self._finalized[k] for k in _STEP_KINDS}

    def run_graphs(self) -> list[fx.Graph]:
        """The graphs of the modules built so far, as they run (legalized; for a lowered one,
        the graph Inductor was given)."""
        graphs = [getattr(module, "graph", None) for module in self._modules_by_kind.values()]
        return [g for g in graphs if isinstance(g, fx.Graph)]

    def source_module(self) -> fx.GraphModule:
        """The module this one was built from; its graph is :attr:`graph` (the edited one)."""
        return self._source

    def _gm_from(self, graph: fx.Graph) -> fx.GraphModule:
        if self.legalize is not None:
            self.legalize(graph)
        graph._codegen = fx.graph.CodeGen()
        return make_graph_module(self._source, graph)

    def _derived_gm(self, kind: str) -> fx.GraphModule:
        derived = self._finalized or derive(self._graph)
        return self._gm_from(derived[kind])

    def _shared_kind(self, kind: str) -> str:
        """Without moves, setup, main, cleanup and plain are one graph: built (and lowered) once."""
        if kind != "flush" and self._finalized is not None and not self._finalized.plan.blocks:
            return "plain"
        return kind

    def _gm(self, kind: str) -> Any:
        if self._finalized is None:
            return self._derived_gm(kind)
        kind = self._shared_kind(kind)
        if kind not in self._modules_by_kind:
            gm = self._gm_from(self._finalized[kind])
            lowered = self.lower is not None and kind != "flush"
            self._modules_by_kind[kind] = self.lower(gm) if lowered else gm  # type: ignore[misc]
        return self._modules_by_kind[kind]

    @property
    def setup_gm(self) -> Any:
        return self._gm("setup")

    @property
    def main_gm(self) -> Any:
        return self._gm("main")

    @property
    def cleanup_gm(self) -> Any:
        return self._gm("cleanup")

    @property
    def num_moves(self) -> int:
        return len([m for m in self._graph.moves if m.alive()])

    @property
    def pending_moves(self) -> int:
        """How many moved blocks of the previous call still have to run."""
        return self.num_moves if self._carried is not None else 0

    def recompile(self) -> None:
        """Regenerate code: a no-op before finalize (graphs are derived on use)."""
        if self._finalized is not None:
            for mod in self._modules_by_kind.values():
                if isinstance(mod, fx.GraphModule):
                    mod.recompile()

    def finalize_setup(self) -> None:
        """Freeze the graph: derive setup/main/cleanup (and flush), lower if asked.

        Each derived graph is built (and its code generated) when it first runs, so finalizing a
        large graph costs little until it is used. With a ``lower`` callable the graphs of the
        first two calls (setup and main) are built and lowered here, cleanup and plain when first
        used; without moves the four are one graph, lowered once.
        """
        if self._finalized is not None:
            return
        t0 = time.perf_counter()
        self._graph.lint()
        self._finalized = derive(self._graph)  # validates; each graph is built on first use
        if self.lower is not None:
            for kind in ("setup", "main"):
                self._gm(kind)
        log.info(
            "IterGraphModule finalized in %.2fs: %d moved block(s), %d carried value(s)%s",
            time.perf_counter() - t0,
            self.num_moves,
            self._finalized.n_carried,
            f", lowered with {getattr(self.lower, '__name__', self.lower)}" if self.lower else "",
        )

    # ------------------------------------------------------------------ running
    def forward(self, *args: Any, last_iter: bool = False) -> Any:
        if self._finalized is None:
            log.info("IterGraphModule used before finalize_setup(); finalizing now")
            self.finalize_setup()
        # nothing of this module's own state changes until a graph returned: a failed call
        # can be retried (it re-runs the pending work on the inputs the caller restored)
        iteration = self._iter + 1
        if self.max_iters > 0 and iteration >= self.max_iters:
            last_iter = True
        if self._carried is None:
            if last_iter:
                out, _ = self._gm("plain")(*args)
                self._end_cycle()
                return out
            out, carried = self._gm("setup")(*args)
            self._carried, self._iter = list(carried), iteration
            return out
        if last_iter:
            out, _ = self._gm("cleanup")(*args, *self._carried)
            self._end_cycle()
            return out
        out, carried = self._gm("main")(*args, *self._carried)
        self._carried, self._iter = list(carried), iteration
        return out

    def _end_cycle(self) -> None:
        self._carried = None
        self._iter = 0
        self.cycles += 1

    def flush(self) -> None:
        """Run the pending moved work now; the next call starts a new cycle."""
        if self._carried is None:
            return
        if self._finalized is None:
            self.finalize_setup()
        with torch.no_grad():  # the moved work writes parameters/state in place, like a step
            self._gm("flush")(*self._carried)
        self._end_cycle()

    def __str__(self) -> str:
        state = "finalized" if self.finalized else "editable"
        return f"IterGraphModule({state}, {self.num_moves} moved block(s))\n{self._graph}"


__all__ = ["IterGraph", "IterGraphModule", "IterMove", "Lowering"]
