"""spmd_backend: compile a whole data-parallel PyTorch training step into one graph.

Front doors: :func:`spmd_backend.compile` (``@compile(gm_transformation=...)`` on
``train_step(model, optim, batch)``), and the pass-development harness
:mod:`spmd_backend.testing`. See README.md and docs/architecture.md.
"""

from spmd_backend.api import CompiledTrainStep, compile
from spmd_backend.errors import (
    SpmdDistributedError,
    SpmdError,
    SpmdGraphError,
    SpmdPassError,
    SpmdRuntimeError,
    SpmdTraceError,
    SpmdUsageError,
)
from spmd_backend.parallel.data_parallel import DataParallel
from spmd_backend.pass_manager import PassManager, PassSpec, declare_pass
from spmd_backend.tracing.binding import mark_dynamic
from spmd_backend.tracing.checkpoint import checkpoint
from spmd_backend.tracing.mod_tracker import ModTracker
from spmd_backend.tracing.overrides import Override

__version__ = "0.1.0"

__all__ = [
    "compile",
    "CompiledTrainStep",
    "DataParallel",
    "ModTracker",
    "Override",
    "checkpoint",
    "mark_dynamic",
    "PassManager",
    "PassSpec",
    "declare_pass",
    "SpmdError",
    "SpmdUsageError",
    "SpmdTraceError",
    "SpmdGraphError",
    "SpmdPassError",
    "SpmdRuntimeError",
    "SpmdDistributedError",
]
