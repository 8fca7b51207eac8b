"""Parity with DDP on models nobody here wrote: transformers GPT-2, Llama, BERT and T5 with padded
attention masks (random init, tiny configs), torch's ``nn.TransformerEncoder`` (padded, and under
a causal mask), ``nn.Transformer`` and its recurrent layers (``nn.LSTM``, a bidirectional
``nn.GRU``), trained with
``AdamW`` as users write it (torch's default implementation) and an LR schedule, 2 gloo ranks.

Batches depend on the rank, so a compiled step without gradient collectives diverges from DDP
(``test_third_party_parity_fails_without_collectives``).
"""

from __future__ import annotations

import pytest

from spmd_backend.testing import OptimSpec, ParityCase, check_ddp_parity
from spmd_backend.testing.parity import without_gradient_collectives

pytestmark = pytest.mark.multirank

pytest.importorskip("transformers")

ADAMW = OptimSpec("adamw", "default", lr=1e-3, weight_decay=0.01, scheduler=True)


@pytest.mark.parametrize("model", ["hf_gpt2", "hf_llama", "hf_bert", "hf_t5", "torch_encoder",
                                   "torch_recurrent"])
def test_third_party_parity(rank_pool, model):
    result = rank_pool.run(check_ddp_parity, ParityCase(model, ADAMW, steps=6, reduce_op="avg"))[0]
    assert result.losses[0] != result.losses[-1], "the model did not train"


def test_recurrent_layers_through_dynamo(rank_pool):
    """nn.LSTM/GRU: Dynamo breaks the graph at them unless ``allow_rnn`` (then the gradient
    audit refused the eager backward), and with oneDNN on they trace into ``mkldnn_rnn_layer``,
    whose backward failed at run time for want of a workspace; both doors trace them with
    oneDNN off (the compile door failed the same way before)."""
    case = ParityCase("torch_recurrent", ADAMW, steps=4, reduce_op="avg",
                      dynamo_options={"inductor": False}, zero_grad_first=True)
    result = rank_pool.run(check_ddp_parity, case)[0]
    assert result.dynamo["graph_breaks"] == 0 and result.dynamo["per_graph_graphs"] == 0, result.dynamo


@pytest.mark.parametrize("door,model", [("compile", "torch_seq2seq"), ("dynamo", "torch_seq2seq"),
                                        ("dynamo", "torch_causal_lm")])
def test_transformer_layers_under_a_causal_mask(rank_pool, model, door):
    """torch's transformer layers given a causal mask and no ``is_causal`` hint decide on the
    mask's values (``_detect_is_causal_mask``): both doors refused these models before
    2026-11-27 (the compile door at the decision, the Dynamo door at the eager gradients its
    graph break left); the trace now applies the mask as given (tracing/causal_mask.py)."""
    case = ParityCase(model, ADAMW, steps=3, reduce_op="avg",
                      dynamo_options={"inductor": False} if door == "dynamo" else None)
    result = rank_pool.run(check_ddp_parity, case)[0]
    assert result.losses[0] != result.losses[-1], "the model did not train"
    if door == "dynamo":
        assert result.dynamo["graph_breaks"] == 0, result.dynamo


def test_third_party_parity_fails_without_collectives(rank_pool):
    case = ParityCase("hf_bert", ADAMW, steps=3, reduce_op="avg",
                      transformation=without_gradient_collectives)
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        rank_pool.run(check_ddp_parity, case)
