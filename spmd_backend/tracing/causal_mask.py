"""torch's transformer layers given a causal mask, traced without a decision on its values.

``nn.TransformerEncoder``, ``nn.TransformerDecoder`` and ``nn.Transformer`` given an attention
mask and no ``is_causal`` hint compare the mask with a generated causal one
(``torch.nn.modules.transformer._detect_is_causal_mask``: ``bool((mask == causal).all())``) to
pick SDPA's causal fast path. That is a Python decision on a tensor's value: the compile door
refused the step, and Dynamo broke the graph there, so the layers' gradients were computed
eagerly and the Dynamo door refused them too. PyTorch's own word-language-model example
(``TransformerEncoder`` with ``generate_square_subsequent_mask``) and the seq2seq tutorial
(``nn.Transformer`` with ``tgt_mask``) were refused in both doors (before 2026-11-27).

:func:`hint_from_argument` is what a trace runs instead: the hint the caller gave
(``is_causal=True``), else ``False``, so the layers apply the mask they were given: the values
are the mask's, whatever it holds; eager would apply the same mask through SDPA's causal flag
when it is causal (equal up to the order of floating-point operations inside the attention
kernel).

:func:`traced_without_mask_decision` installs it for the compile door's trace (module
attribute, restored after); :data:`ORIGINAL` is the function the Dynamo door's inliner swaps
(:mod:`spmd_backend.dynamo.scope`), so Dynamo's guard on the global stays valid.

Requires torch 2.13's ``torch.nn.modules.transformer._detect_is_causal_mask(mask, is_causal,
size)``; without it nothing is installed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch.nn.modules.transformer as _transformer

#: torch's detection, or None where this torch has none
ORIGINAL: Any = getattr(_transformer, "_detect_is_causal_mask", None)


def hint_from_argument(mask: Any, is_causal: bool | None = None, size: int | None = None) -> bool:
    """The causal hint a trace uses: the caller's ``is_causal`` if it is ``True``, else ``False``
    (the given mask is applied as it is; module docstring)."""
    return is_causal is True


@contextlib.contextmanager
def traced_without_mask_decision() -> Iterator[None]:
    """While active, torch's transformer layers take :func:`hint_from_argument`."""
    if ORIGINAL is None or _transformer.__dict__.get("_detect_is_causal_mask") is not ORIGINAL:
        yield
        return
    _transformer._detect_is_causal_mask = hint_from_argument
    try:
        yield
    finally:
        _transformer._detect_is_causal_mask = ORIGINAL


__all__ = ["ORIGINAL", "hint_from_argument", "traced_without_mask_decision"]
