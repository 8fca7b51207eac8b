"""lowering/cat_layout.py: a concatenation Inductor reduces to one tensor is copied in eager's
layout, so the ``view`` traced after it still applies and the graph compiles.

transformers' key/value cache is an empty 1-D tensor concatenated with transposed keys; before
2026-11-28 Inductor's re-trace failed at the ``view`` after it and T5 (and GPT-2 with attention
dropout) ran every step as the fx graph. The end-to-end check is tests/test_third_party.py's
Inductor case.
"""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from spmd_backend.graph import ops
from spmd_backend.lowering import InductorModule
from spmd_backend.lowering.cat_layout import keep_cat_layouts
from spmd_backend.lowering.inductor import lower_to_inductor


def _cache_then_matmul(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """What transformers' cache does with an empty cache: cat, transpose, matmul (a view)."""
    keys = torch.cat([torch.tensor([]), k.transpose(1, 2)], dim=-2)
    return torch.matmul(q, keys.transpose(-2, -1))


def _channels_last(x: torch.Tensor) -> torch.Tensor:
    """A lone channels_last tensor: eager's ``cat`` keeps its format."""
    return torch.cat([x.to(memory_format=torch.channels_last)]).flatten(2)


def _two_left(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Two tensors left after filtering: Inductor concatenates them itself, nothing to copy."""
    return torch.cat([a, torch.tensor([]), b.t()], dim=0).view(-1)


def _inputs(name: str) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    if name == "cache":
        return torch.randn(4, 2, 16, 8, generator=gen), torch.randn(4, 8, 2, 8, generator=gen)
    if name == "channels_last":
        return (torch.randn(2, 3, 4, 5, generator=gen),)
    return torch.randn(3, 4, generator=gen), torch.randn(4, 3, generator=gen)


FNS = {"cache": _cache_then_matmul, "channels_last": _channels_last, "two_left": _two_left}


@pytest.mark.parametrize("name,rewritten", [("cache", 1), ("channels_last", 1), ("two_left", 0)])
def test_one_tensor_left_is_copied_in_the_traced_layout(name, rewritten):
    fn, args = FNS[name], _inputs(name)
    gm = make_fx(fn)(*args)
    cats = [n for n in gm.graph.nodes if n.target in ops.CAT_TARGETS]
    traced = [n.meta["val"].stride() for n in cats]
    assert keep_cat_layouts(gm) == rewritten
    gm.graph.lint()
    left = [n for n in gm.graph.nodes if n.target in ops.CAT_TARGETS]
    assert len(left) == len(cats) - rewritten
    if rewritten:
        copy = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.clone.default)
        assert copy.meta["val"].stride() == traced[0]
    torch.testing.assert_close(gm(*args), fn(*args), rtol=0, atol=0)


def test_a_cached_key_concatenation_compiles_with_inductor():
    """Without the rewrite Inductor's re-trace raises "Cannot view a tensor ..." and
    ``lower_to_inductor`` falls back to the fx graph (returns it)."""
    args = _inputs("cache")
    gm = make_fx(_cache_then_matmul, tracing_mode="fake")(*args)
    lowered = lower_to_inductor(gm)
    assert isinstance(lowered, InductorModule), "Inductor fell back to the fx graph"
    torch.testing.assert_close(lowered(*args), _cache_then_matmul(*args))
