"""GraphModuleTransformation: the default transformation for ``spmd_backend.compile``.

``GraphModuleTransformation(enable_graph_optimization=False, enable_inductor=False,
dump_graphs=False)`` wraps the expanded step graph in an
:class:`~spmd_backend.iter_graph_module.IterGraphModule`, runs the default pass pipeline
(comm_fusion_with_concat, schedule_comm_wait, remove_copy_from_optimizer) through a
:class:`~spmd_backend.pass_manager.PassManager` when graph optimization is enabled, finalizes,
and lowers the graphs to Inductor when enabled. With ``dump_graphs`` every graph before and
after each pass, and the final setup/main/cleanup graphs, are written to a new folder whose path
is logged (and kept in :attr:`dump_folder`).
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Iterable, Sequence

import torch.fx as fx

from spmd_backend.graph.utils import dump_graphs_to_files
from spmd_backend.iter_graph_module import IterGraphModule
from spmd_backend.lowering import lower_to_inductor
from spmd_backend.pass_manager import PassManager, PassRecord
from spmd_backend.passes import default_pipeline

log = logging.getLogger(__name__)

#: DDP's default bucket size
DEFAULT_BUCKET_SIZE_MB = 25.0


class GraphModuleTransformation:
    """Wrap, optimize, finalize and lower a step graph (see the module docstring).

    ``bucket_size_mb``: bucket cap of comm_fusion_with_concat; ``extra_passes``: more passes
    (or ``(pass, kwargs)`` pairs) for the manager, ordered with the default ones by their
    declarations; ``skip_passes``: names to skip.
    """

    def __init__(
        self,
        *,
        enable_graph_optimization: bool = False,
        enable_inductor: bool = False,
        dump_graphs: bool = False,
        bucket_size_mb: float = DEFAULT_BUCKET_SIZE_MB,
        extra_passes: Sequence[object] = (),
        skip_passes: Iterable[str] = (),
    ) -> None:
        self.enable_graph_optimization = enable_graph_optimization
        self.enable_inductor = enable_inductor
        self.dump_graphs = dump_graphs
        self.bucket_size_mb = bucket_size_mb
        self.extra_passes = list(extra_passes)
        self.skip_passes = list(skip_passes)
        self.dump_folder: str | None = None
        self.pass_records: list[PassRecord] = []

    def pipeline(self) -> list[object]:
        return [*default_pipeline(self.bucket_size_mb), *self.extra_passes]

    def __call__(self, gm: fx.GraphModule) -> IterGraphModule:
        if self.dump_graphs:
            self.dump_folder = tempfile.mkdtemp(prefix="spmd_graphs_")
            log.warning("spmd_backend: dumping graphs to %s", self.dump_folder)
            dump_graphs_to_files({"traced": gm.graph}, self.dump_folder)
        igm = IterGraphModule(gm, lower=lower_to_inductor if self.enable_inductor else None)
        if self.enable_graph_optimization:
            manager = PassManager(self.pipeline(), skip=self.skip_passes, dump_dir=self.dump_folder)
            self.pass_records = manager.run(igm)
        igm.finalize_setup()
        if self.dump_folder:
            derived = {kind: getattr(igm, f"{kind}_gm") for kind in ("setup", "main", "cleanup")}
            dump_graphs_to_files(
                {f"final.{k}": g.graph for k, g in derived.items() if hasattr(g, "graph")},
                self.dump_folder,
            )
        return igm
