"""GraphModuleTransformation: the compile door's face over the one pipeline.

``GraphModuleTransformation(enable_graph_optimization=False, enable_inductor=False,
dump_graphs=False, bucket_size_mb=25, extra_passes=(), skip_passes=(), background_compile=None)``
is the seed's
transformation: called with the expanded step graph, it runs
:func:`spmd_backend.pipeline.transform` (IterGraphModule, the default passes through a
PassManager when graph optimization is enabled, Inductor when enabled) with a
:class:`~spmd_backend.pipeline.PipelineConfig` built from its arguments (validated by the same
code as ``torch.compile``'s options). With ``dump_graphs`` every graph before and after each
pass, and the final setup/main/cleanup graphs, are written to a folder whose path is logged and
kept in :attr:`dump_folder`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch.fx as fx

from spmd_backend.graph.comm import DEFAULT_BUCKET_SIZE_MB
from spmd_backend.iter_graph_module import IterGraphModule
from spmd_backend.pass_manager import PassRecord
from spmd_backend.pipeline import PipelineConfig, transform


class GraphModuleTransformation:
    """Wrap, optimize, finalize and lower a step graph (see the module docstring).

    ``bucket_size_mb``: bucket cap of comm_fusion_with_concat; ``extra_passes``: more passes
    (or ``(pass, kwargs)`` pairs) for the manager, ordered with the default ones by their
    declarations; ``skip_passes``: names to skip; ``background_compile``: compile with
    Inductor in a background process while the fx graph runs (None: the pipeline's default).
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
        background_compile: bool | None = None,
    ) -> None:
        more = {} if background_compile is None else {"background_compile": background_compile}
        self.config = PipelineConfig(
            optimize=enable_graph_optimization,
            bucket_size_mb=bucket_size_mb,
            extra_passes=tuple(extra_passes),
            skip_passes=tuple(skip_passes),
            inductor=enable_inductor,
            dump_graphs=bool(dump_graphs),
            **more,
        )
        self.pass_records: list[PassRecord] = []

    @property
    def dump_folder(self) -> str | None:
        return self.config.dump_folder

    def __call__(self, gm: fx.GraphModule) -> IterGraphModule:
        result = transform(gm, self.config)
        self.pass_records = result.records
        return result.module
