"""Tracing layer: turn a Python train step into one functional aten-level fx graph.

Imports only :mod:`spmd_backend.graph` and the error hierarchy.
"""
