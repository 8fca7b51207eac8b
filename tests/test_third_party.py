"""Parity with DDP on models nobody here wrote: transformers GPT-2, Llama, BERT and T5 with padded
attention masks (random init, tiny configs), GPT-2 with its config's dropout, peft's LoRA on
Llama, gpt-oss (a mixture of experts), torch's ``nn.TransformerEncoder`` (padded, and under a causal mask), ``nn.Transformer``
and its recurrent layers (``nn.LSTM``, a bidirectional ``nn.GRU``), trained with
``AdamW`` as users write it (torch's default implementation) and an LR schedule, 2 gloo ranks.

Batches depend on the rank, so a compiled step without gradient collectives diverges from DDP
(``test_third_party_parity_fails_without_collectives``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import pytest

from spmd_backend.testing import OptimSpec, ParityCase, check_ddp_parity
from spmd_backend.testing.parity import without_gradient_collectives

pytestmark = pytest.mark.multirank

pytest.importorskip("transformers")

ADAMW = OptimSpec("adamw", "default", lr=1e-3, weight_decay=0.01, scheduler=True)


@pytest.mark.parametrize("model", ["hf_gpt2", "hf_gpt2_dropout", "hf_llama", "hf_lora_llama",
                                   "hf_gpt_oss", "hf_bert", "hf_t5", "torch_encoder", "torch_recurrent"])
def test_third_party_parity(rank_pool, model):
    if model == "hf_lora_llama":
        pytest.importorskip("peft")
    result = rank_pool.run(check_ddp_parity, ParityCase(model, ADAMW, steps=6, reduce_op="avg"))[0]
    assert result.losses[0] != result.losses[-1], "the model did not train"


def test_recurrent_layers_through_dynamo(rank_pool):
    """nn.LSTM/GRU: Dynamo breaks the graph at them unless ``allow_rnn`` (then the gradient
    audit refused the eager backward), and with oneDNN on they trace into ``mkldnn_rnn_layer``,
    whose backward failed at run time for want of a workspace; both doors trace them with
    oneDNN off (the compile door failed the same way before). The LSTM's dropout between its
    layers: torch 2.13's decomposition drops it, so until 2026-11-28 this door trained without
    it (dynamo/rnn_dropout.py)."""
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


def test_mixture_of_experts_through_dynamo(rank_pool):
    """transformers' gpt-oss through ``backend="spmd"``: the router sends each rank's tokens to
    other experts, and every expert's gradient is still reduced as DDP's is. One whole-step
    graph."""
    case = ParityCase("hf_gpt_oss", ADAMW, steps=3, reduce_op="avg",
                      dynamo_options={"inductor": False})
    result = rank_pool.run(check_ddp_parity, case)[0]
    assert result.dynamo["graph_breaks"] == 0 and result.dynamo["per_graph_graphs"] == 0, result.dynamo
    assert result.losses[0] != result.losses[-1], "the model did not train"


def test_lora_through_dynamo(rank_pool):
    """peft's LoRA (frozen base, adapters with dropout) through ``backend="spmd"``: one
    whole-step graph, the same dropout masks as DDP's step."""
    pytest.importorskip("peft")
    case = ParityCase("hf_lora_llama", ADAMW, steps=4, reduce_op="avg",
                      dynamo_options={"inductor": False})
    result = rank_pool.run(check_ddp_parity, case)[0]
    assert result.dynamo["graph_breaks"] == 0 and result.dynamo["per_graph_graphs"] == 0, result.dynamo
    assert result.losses[0] != result.losses[-1], "the model did not train"


def _with_passes_and_inductor_job(rank: int, world_size: int) -> list[str]:
    """check_ddp_parity of a one-layer ``hf_gpt2_dropout`` through the compile door with the
    default passes and a blocking Inductor compile (one layer: the compile is most of the
    test's time); returns the lowering's warnings (a fallback to the fx graph is one)."""
    from spmd_backend.gm_transformation import GraphModuleTransformation
    from spmd_backend.testing import third_party

    registered = third_party.THIRD_PARTY_MODELS["hf_gpt2_dropout"]
    model = dataclasses.replace(registered, build=functools.partial(third_party._gpt2, 0.1, layers=1))

    warnings: list[str] = []

    class _Record(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    handler = _Record(logging.WARNING)
    lowering = logging.getLogger("spmd_backend.lowering")
    lowering.addHandler(handler)
    try:
        transformation = GraphModuleTransformation(
            enable_graph_optimization=True, enable_inductor=True, background_compile=False)
        check_ddp_parity(rank, world_size, ParityCase(model, ADAMW, steps=3, reduce_op="avg",
                                                      transformation=transformation))
    finally:
        lowering.removeHandler(handler)
    return warnings


@pytest.mark.slow
def test_dropout_model_with_passes_and_inductor(rank_pool):
    """GPT-2 with its config's dropout, lowered by Inductor: the compiled step draws eager's
    masks (DDP's step draws from the same generator state). Its attention concatenates the
    transposed keys with transformers' empty cache; until 2026-11-28 Inductor could not compile
    that graph (lowering/cat_layout.py) and every step ran as the fx graph."""
    warnings = rank_pool.run(_with_passes_and_inductor_job)
    assert warnings == [[], []], warnings


def test_third_party_parity_fails_without_collectives(rank_pool):
    case = ParityCase("hf_bert", ADAMW, steps=3, reduce_op="avg",
                      transformation=without_gradient_collectives)
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        rank_pool.run(check_ddp_parity, case)
