"""Lowering: compile step graphs with Inductor (C++ on CPU, Triton on GPU)."""

from spmd_backend.lowering.inductor import InductorModule, example_inputs, lower_to_inductor

__all__ = ["InductorModule", "example_inputs", "lower_to_inductor"]
