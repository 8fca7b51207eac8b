"""The dropout between the layers of ``nn.RNN``/``nn.GRU``/``nn.LSTM``, which torch 2.13's
decomposition of those layers drops.

The whole-step scope sets Dynamo's ``allow_rnn``, so a recurrent layer is traced into the step's
graph, and AOTAutograd then expands it with torch's Python decomposition
(``torch._decomp.decompositions._rnn_helper``, shared by the RNN, GRU and LSTM decompositions).
In torch 2.13 that helper overwrites the ``dropout`` probability with 0 at the first layer (its
test ``num_layers < i - 1`` never holds), so a model built with ``num_layers > 1, dropout > 0``
trained through ``backend="spmd"`` without the dropout eager applies between layers: 0.05 off
DDP after three Adam steps, silently (hunt 32, 2026-11-28). Stock ``torch.compile`` breaks the
graph at recurrent layers and runs them eagerly, so it never reaches the helper; the compile
door traces torch's C++ implementation, which applies it.

:func:`layers_with_dropout` is the helper as eager behaves: each layer (both directions when
bidirectional) through the decomposition's own ``layer_fn``, and ``torch.dropout`` on every
layer's output but the last, in training. :func:`patch` installs it for the scope.

Requires: the decomposition's signature and its ``params_hiddens`` helper as in torch 2.13
(checked when the patch is built: another torch version keeps its own helper).
Guarantees: the same layers, in the same order, as torch's helper; only the dropout differs.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch._decomp.decompositions as decompositions

#: the helper's parameters in torch 2.13, the only version this replacement is written for
_SIGNATURE = ("input", "hidden", "params", "has_biases", "num_layers", "dropout", "train",
              "bidirectional", "batch_first", "layer_fn")


def layers_with_dropout(
    input: torch.Tensor,
    hidden: Any,
    params: Any,
    has_biases: bool,
    num_layers: int,
    dropout: float,
    train: bool,
    bidirectional: bool,
    batch_first: bool,
    layer_fn: Any,
) -> tuple[torch.Tensor, list[Any]]:
    """A multi-layer recurrent layer, time-major inside; returns its output and the final hidden
    state of every layer and direction, in torch's order."""
    seq = input.transpose(0, 1) if batch_first else input
    finals: list[Any] = []
    for layer in range(num_layers):
        forward_params, forward_hidden, reverse_params, reverse_hidden = (
            decompositions.params_hiddens(params, hidden, layer, bidirectional))
        out, last = layer_fn(seq, forward_hidden, forward_params, has_biases)
        finals.append(last)
        if bidirectional:
            out_reverse, last_reverse = layer_fn(seq, reverse_hidden, reverse_params, has_biases,
                                                 reverse=True)
            finals.append(last_reverse)
            out = torch.cat([out, out_reverse], out.dim() - 1)
        seq = out
        if train and dropout != 0 and layer < num_layers - 1:
            seq = torch.dropout(seq, dropout, train=True)
    return (seq.transpose(0, 1) if batch_first else seq), finals


def patch() -> tuple[Any, str, Any] | None:
    """(owner, attribute, replacement) for the scope, or None where torch's helper is not the
    one this module replaces."""
    helper = getattr(decompositions, "_rnn_helper", None)
    if helper is None or not hasattr(decompositions, "params_hiddens"):
        return None
    if tuple(inspect.signature(helper).parameters) != _SIGNATURE:
        return None
    return (decompositions, "_rnn_helper", layers_with_dropout)
