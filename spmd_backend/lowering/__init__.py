"""Lowering: compile step graphs with Inductor (C++ on CPU, Triton on GPU), blocking or in a
background process."""

from spmd_backend.lowering.background import (
    BackgroundLowered,
    lower_in_background,
    pending,
    wait_for_background,
)
from spmd_backend.lowering.inductor import InductorModule, example_inputs, lower_to_inductor

__all__ = [
    "BackgroundLowered", "InductorModule", "example_inputs", "lower_in_background",
    "lower_to_inductor", "pending", "wait_for_background",
]
