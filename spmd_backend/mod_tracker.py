"""Seed-compatible face: ``from spmd_backend.mod_tracker import ModTracker``."""

from spmd_backend.tracing.mod_tracker import ModTracker

__all__ = ["ModTracker"]
