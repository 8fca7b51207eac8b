"""Parallel layer: turn the tracer's markers into collectives (data parallelism).

Imports :mod:`spmd_backend.graph` and torch.distributed.
"""

from spmd_backend.parallel.data_parallel import DataParallel, ExpansionReport, expand_data_parallel

__all__ = ["DataParallel", "ExpansionReport", "expand_data_parallel"]
