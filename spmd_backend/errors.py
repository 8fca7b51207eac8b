"""The one exception hierarchy of spmd_backend.

Every error the library raises on purpose derives from :class:`SpmdError`, so callers can catch
the whole family. Messages name the offending object (argument, parameter, pass, node) and say
what to do instead. ``AssertionError`` is used only where the upstream seed tests demand it
(pass ordering in ``graph_optimization``).
"""

from __future__ import annotations


class SpmdError(Exception):
    """Base class of every error raised by spmd_backend."""


class SpmdUsageError(SpmdError, ValueError):
    """The caller passed something the backend cannot work with (bad arguments, bad step)."""


class SpmdTraceError(SpmdError, RuntimeError):
    """Tracing the train step failed or produced a graph the backend cannot use."""


class SpmdGraphError(SpmdError, RuntimeError):
    """A graph violates an invariant (for example after a pass)."""


class SpmdPassError(SpmdError, RuntimeError):
    """A graph pass cannot be applied (bad target, unsafe move, missing pattern)."""


class SpmdDistributedError(SpmdError, RuntimeError):
    """The process group is missing or unsuitable, or ranks disagree."""


class SpmdRuntimeError(SpmdError, RuntimeError):
    """A compiled step failed while running; the message names the node, and the inputs the
    step had written before failing were restored."""


class SpmdSerializationError(SpmdError, RuntimeError):
    """A graph cannot be written to bytes (a target or a value that cannot travel); callers
    that cache compiled steps treat it as "do not cache", never as a failed step."""
