"""ONE configuration and the stages every step graph goes through, behind both front doors.

::

    spmd_backend.compile(step)                 torch.compile(step, backend="spmd")
      tracing.trace_train_step                   Dynamo graph -> dynamo.capture (markers) -> AOT
      (markers, phases, float64 bias              (the same markers, phases, float64 bias
       corrections)                                corrections)
                 \\                                /
                  ▼                              ▼
           ┌──────────── Pipeline(config) ─────────────┐
           │ sync:      module state broadcast once per (tensor, group)   (parallel.state_sync)
           │ expand:    grad_ready / grad_contribution / buffer_sync markers -> collectives
           │ transform: IterGraphModule + PassManager(passes) + Inductor or the fx graph
           └───────────────────────────────────────────┘

:class:`PipelineConfig` is the one configuration, each default written once here:
``reduce_op`` (the compile door keeps the upstream SUM contract, the Dynamo door replaces DDP
and averages: :data:`DEFAULT_REDUCE_OP`), bucket cap (DDP's 25 MB), passes, skipped passes,
Inductor (compiled in a background process while the fx graph runs, or blocking:
``background_compile``, default from ``SPMD_BACKEND_BACKGROUND_COMPILE``, see
:mod:`spmd_backend.lowering.background`), dump folder, process group and DDP's buffer/state
broadcasts. Both doors build it
through the same validation (:meth:`PipelineConfig.from_options` for ``torch.compile``'s
``options``; :class:`~spmd_backend.gm_transformation.GraphModuleTransformation` for the
compile door's transformation).
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from spmd_backend.errors import SpmdUsageError
from spmd_backend.graph.comm import DEFAULT_BUCKET_SIZE_MB
from spmd_backend.graph.utils import dump_graphs_to_files
from spmd_backend.iter_graph_module import IterGraphModule
from spmd_backend.lowering import lower_in_background, lower_to_inductor
from spmd_backend.parallel.data_parallel import DataParallel, ExpansionReport, expand_data_parallel
from spmd_backend.parallel.gloo_all_gather import serialize_all_gathers
from spmd_backend.parallel.state_sync import sync_module_states
from spmd_backend.pass_manager import PassManager, PassRecord, pass_spec_of
from spmd_backend.passes import default_pipeline

log = logging.getLogger(__name__)

#: environment variable that sets the default of ``background_compile`` ("0": blocking compiles)
BACKGROUND_COMPILE_ENV = "SPMD_BACKEND_BACKGROUND_COMPILE"


def _env_flag(name: str, default: bool = True) -> bool:
    value = os.environ.get(name)
    return default if value is None else value.strip().lower() not in ("0", "false", "no", "")


#: the reduction each front door uses unless told otherwise (the compile door's is DataParallel's
#: own default, the upstream SUM contract; the Dynamo door replaces DDP, which averages)
DEFAULT_REDUCE_OP: dict[str, str] = {"compile": DataParallel().reduce_op, "dynamo": "avg"}


@dataclass(frozen=True)
class PipelineConfig:
    """What the pipeline does to a step graph (see the module docstring).

    ``passes``: ``None`` for the default passes (bucketing, wait scheduling and, for graphs
    holding the optimizer, the in-place optimizer), or an explicit list (``()``: none);
    ``extra_passes`` are added to either. Items are passes or ``(pass, kwargs)`` pairs, ordered
    by the PassManager from their declarations. ``dump_graphs``: a folder, ``True`` for a new
    temporary one, or ``False``.
    """

    parallel: DataParallel = field(default_factory=DataParallel)
    optimize: bool = True
    bucket_size_mb: float = DEFAULT_BUCKET_SIZE_MB
    passes: tuple[Any, ...] | None = None
    extra_passes: tuple[Any, ...] = ()
    skip_passes: tuple[str, ...] = ()
    inductor: bool = False
    background_compile: bool = field(default_factory=lambda: _env_flag(BACKGROUND_COMPILE_ENV))
    dump_graphs: str | bool = False

    def __post_init__(self) -> None:
        bucket = self.bucket_size_mb
        if isinstance(bucket, bool) or not isinstance(bucket, (int, float)) or bucket <= 0:
            raise SpmdUsageError(f"bucket_size_mb must be a positive number, got {bucket!r}")
        if not isinstance(self.background_compile, bool):
            raise SpmdUsageError(
                f"background_compile must be True or False, got {self.background_compile!r}"
            )
        if not isinstance(self.parallel, DataParallel):
            raise SpmdUsageError(
                f"expected a DataParallel, got {type(self.parallel).__qualname__}"
            )
        for p in (*(self.passes or ()), *self.extra_passes):
            pass_spec_of(p[0] if isinstance(p, tuple) else p)  # names an unknown pass
        if self.dump_graphs is True:
            object.__setattr__(self, "dump_graphs", tempfile.mkdtemp(prefix="spmd_graphs_"))
            log.warning("spmd_backend: dumping graphs to %s", self.dump_graphs)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None, door: str) -> PipelineConfig:
        """``torch.compile(..., options=...)`` as a config; unknown keys name the valid ones."""
        options = dict(options or {})
        unknown = sorted(set(options) - set(OPTION_NAMES))
        if unknown:
            raise SpmdUsageError(
                f'backend="spmd": unknown option(s) {unknown}; valid options are '
                f"{sorted(OPTION_NAMES)}"
            )
        parallel = DataParallel(
            reduce_op=options.pop("reduce_op", DEFAULT_REDUCE_OP[door]),
            group=options.pop("process_group", None),
            broadcast_buffers=bool(options.pop("broadcast_buffers", True)),
            sync_module_states=bool(options.pop("sync_module_states", True)),
            check_finite_grads=bool(options.pop("check_finite_grads", False)),
            check_consistency=bool(options.pop("check_consistency", True)),
            consistency_timeout_s=options.pop("consistency_timeout_s", 300.0),
            gradient_compression=options.pop("gradient_compression", None),
            shard_optimizer=options.pop("shard_optimizer", False),
            reduce_scatter_grads=options.pop("reduce_scatter_grads", None),
        )
        passes = options.pop("passes", None)
        skip = options.pop("skip_passes", ())
        return cls(
            parallel=parallel,
            bucket_size_mb=options.pop("bucket_size_mb", DEFAULT_BUCKET_SIZE_MB),
            passes=None if passes is None else tuple(passes),
            skip_passes=tuple(skip),
            inductor=bool(options.pop("inductor", True)),
            **({"background_compile": options.pop("background_compile")}
               if "background_compile" in options else {}),
            dump_graphs=options.pop("dump_graphs", False) or False,
        )

    @property
    def dump_folder(self) -> str | None:
        return self.dump_graphs if isinstance(self.dump_graphs, str) else None

    def lowering(self) -> Any:
        """The lowering callable for IterGraphModule: None (the fx graph runs), the blocking
        Inductor compile, or the background one."""
        if not self.inductor:
            return None
        return lower_in_background if self.background_compile else lower_to_inductor

    def pass_list(self, with_optimizer: bool = True) -> list[Any]:
        """The passes to run on a graph (with or without the optimizer in it)."""
        base = default_pipeline(self.bucket_size_mb, with_optimizer=with_optimizer)
        return [*(base if self.passes is None else self.passes), *self.extra_passes]


#: the keys ``torch.compile(..., backend="spmd", options=...)`` accepts
OPTION_NAMES: tuple[str, ...] = (
    "reduce_op", "process_group", "broadcast_buffers", "sync_module_states", "check_finite_grads",
    "check_consistency", "consistency_timeout_s", "gradient_compression", "shard_optimizer",
    "reduce_scatter_grads", "bucket_size_mb", "passes", "skip_passes", "inductor",
    "background_compile", "dump_graphs",
)


# ---------------------------------------------------------------------- stages
def sync(tensors: Iterable[Any], config: PipelineConfig, names: Sequence[str] | None = None, *,
         verify: bool = True) -> int:
    """DDP's constructor: the ranks' tensors verified alike (names, shapes, dtypes) and broadcast
    from the first rank, once per (tensor, process group); see parallel.state_sync."""
    return sync_module_states(tensors, config.parallel, names, verify=verify)


def expand(gm: fx.GraphModule, config: PipelineConfig, *, recompile: bool = True) -> ExpansionReport:
    """Markers -> collectives on the configured group (see parallel.data_parallel)."""
    return expand_data_parallel(gm, config.parallel, recompile=recompile)


@dataclass
class Transformed:
    """What :func:`transform` made of a graph: the module to run and what each pass did."""

    module: IterGraphModule
    records: list[PassRecord]


def transform(
    gm: fx.GraphModule, config: PipelineConfig, *, with_optimizer: bool = True, tag: str = ""
) -> Transformed:
    """Wrap ``gm`` in an IterGraphModule, run the configured passes, finalize and lower.
    Dumps (when configured) are named ``[<tag>.]traced``, per pass, and ``[<tag>.]final.<kind>``."""
    folder = config.dump_folder
    prefix = f"{tag}." if tag else ""
    if folder:
        dump_graphs_to_files({f"{prefix}traced": gm.graph}, folder)
    igm = IterGraphModule(gm, lower=config.lowering(), legalize=serialize_all_gathers)
    records: list[PassRecord] = []
    if config.optimize:
        manager = PassManager(config.pass_list(with_optimizer), skip=config.skip_passes,
                              dump_dir=folder)
        records = manager.run(igm)
    igm.finalize_setup()
    if folder:
        dump_graphs_to_files(
            {f"{prefix}final.{k}": g for k, g in igm.source_graphs().items()}, folder
        )
    return Transformed(igm, records)


__all__: Sequence[str] = [
    "DEFAULT_BUCKET_SIZE_MB", "DEFAULT_REDUCE_OP", "OPTION_NAMES", "PipelineConfig", "Transformed",
    "expand", "sync", "transform",
]
