"""Models nobody on this project wrote: transformers (random init, tiny configs) and torch's own
``nn.TransformerEncoder``, with padded batches, for parity tests against DDP.

Registered in :data:`spmd_backend.testing.models.MODELS` as ``hf_gpt2``, ``hf_gpt2_dropout``
(GPT2Config's default dropout), ``hf_llama``, ``hf_lora_llama`` (peft's LoRA with dropout on it),
``hf_gpt_oss`` (a mixture of experts), ``hf_bert``, ``hf_t5``, ``torch_encoder``, ``torch_recurrent``, ``torch_causal_lm`` (a
``TransformerEncoder`` under a causal mask) and ``torch_seq2seq`` (``nn.Transformer``).
transformers (and peft) are imported only when one of them is built.
Dropout is off except in the two models named for it (a parity check gives both sides the same
generator state, so those compare mask for mask where the compiled step draws as eager does);
every batch pads some rows (so the attention-mask code paths run) and depends on the generator
(so a step without gradient collectives diverges from DDP).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from spmd_backend.testing.models import ModelEntry

VOCAB = 96
SEQ = 16
BATCH = 4


def _padded_tokens(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=gen)
    lengths = torch.randint(SEQ // 2, SEQ + 1, (BATCH,), generator=gen)
    lengths[0] = SEQ  # at least one full row
    mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
    return ids * mask, mask


def _gpt2(dropout: float = 0.0, layers: int = 2) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=layers, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    # an explicit loss type: otherwise transformers logs a warning on the first forward, which
    # is a graph break for torch.compile
    model.loss_type = "ForCausalLM"
    return model


def _gpt2_batch(gen: torch.Generator) -> dict[str, torch.Tensor]:
    ids, mask = _padded_tokens(gen)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                         max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0,
                         pad_token_id=0)
    model = LlamaForCausalLM(config)
    model.loss_type = "ForCausalLM"  # as for GPT-2: no warning (a graph break) on first use
    return model


def _lora_llama() -> nn.Module:
    """peft's LoRA on the Llama above, as fine-tuning scripts apply it: rank-4 adapters with
    dropout on the query and value projections, every other weight frozen."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"])
    return get_peft_model(_llama(), config)


def _gpt_oss() -> nn.Module:
    """transformers' gpt-oss: a mixture of experts (4 experts, 2 per token, router and expert
    weights with biases, the experts held as 3-D parameters), attention sinks, and sliding-window
    layers alternating with full attention."""
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, head_dim=8,
                          num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=8,
                          layer_types=["sliding_attention", "full_attention"], vocab_size=VOCAB,
                          max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0,
                          pad_token_id=0)
    model = GptOssForCausalLM(config)
    model.loss_type = "ForCausalLM"
    return model


def _bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                        intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=SEQ,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(config)


def _bert_batch(gen: torch.Generator) -> dict[str, torch.Tensor]:
    ids, mask = _padded_tokens(gen)
    return {"input_ids": ids, "attention_mask": mask,
            "labels": torch.randint(0, 2, (BATCH,), generator=gen)}


def _t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(num_layers=2, num_decoder_layers=2, d_model=32, d_ff=64, num_heads=2,
                      d_kv=16, vocab_size=VOCAB, dropout_rate=0.0, decoder_start_token_id=0,
                      pad_token_id=0)
    return T5ForConditionalGeneration(config)


def _t5_batch(gen: torch.Generator) -> dict[str, torch.Tensor]:
    ids, mask = _padded_tokens(gen)
    return {"input_ids": ids, "attention_mask": mask,
            "labels": torch.randint(1, VOCAB, (BATCH, SEQ // 2), generator=gen)}


def _hf_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


def _encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(d_model=32, nhead=2, dim_feedforward=64, dropout=0.0,
                                       batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)


def _encoder_batch(gen: torch.Generator) -> dict[str, torch.Tensor]:
    _, mask = _padded_tokens(gen)
    return {"src": torch.randn(BATCH, SEQ, 32, generator=gen), "src_key_padding_mask": mask == 0}


def _encoder_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    out = model(**batch)
    keep = (~batch["src_key_padding_mask"]).unsqueeze(-1)
    return (out * keep).pow(2).mean()


class _CausalLM(nn.Module):
    """PyTorch's word-language-model example in small: a ``TransformerEncoder`` under the causal
    mask ``nn.Transformer.generate_square_subsequent_mask`` builds, no ``is_causal`` hint."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(input_ids.shape[1],
                                                              device=input_ids.device)
        return self.head(self.encoder(self.emb(input_ids), mask=mask))


def _causal_lm_batch(gen: torch.Generator) -> dict[str, torch.Tensor]:
    ids, _ = _padded_tokens(gen)
    return {"input_ids": ids}


def _causal_lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    ids = batch["input_ids"]
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


class _Seq2Seq(nn.Module):
    """The seq2seq tutorial's ``nn.Transformer``: a causal ``tgt_mask`` and source padding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.transformer = nn.Transformer(32, 2, 1, 1, 64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, src_padding: torch.Tensor) -> torch.Tensor:
        tgt_mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], device=tgt.device)
        out = self.transformer(self.emb(src), self.emb(tgt), tgt_mask=tgt_mask,
                               src_key_padding_mask=src_padding,
                               memory_key_padding_mask=src_padding)
        return self.head(out)


def _seq2seq_batch(gen: torch.Generator) -> dict[str, torch.Tensor]:
    ids, mask = _padded_tokens(gen)
    tgt, _ = _padded_tokens(gen)
    return {"src": ids, "tgt": tgt[:, :8], "src_padding": mask == 0}


def _seq2seq_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    tgt = batch["tgt"]
    logits = model(batch["src"], tgt[:, :-1], batch["src_padding"])
    return nn.functional.cross_entropy(logits.flatten(0, 1), tgt[:, 1:].flatten())


class _Recurrent(nn.Module):
    """torch's recurrent layers as a sequence classifier: an embedding with a padding index, a
    two-layer LSTM with dropout between its layers and a bidirectional GRU over its outputs, a
    head on the last step."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16, padding_idx=0)
        self.lstm = nn.LSTM(16, 32, num_layers=2, batch_first=True, dropout=0.2)
        self.gru = nn.GRU(32, 16, batch_first=True, bidirectional=True)
        self.head = nn.Linear(32, 4)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.emb(input_ids))
        out, _ = self.gru(out)
        return self.head(out[:, -1])


def _recurrent_batch(gen: torch.Generator) -> dict[str, torch.Tensor]:
    ids, _ = _padded_tokens(gen)
    return {"input_ids": ids[:, :6]}  # traced unrolled over time: short sequences keep it quick


def _recurrent_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).pow(2).mean()


def _key_bias(name: str, param: torch.Tensor) -> Any:
    """Attention key biases get a zero gradient (softmax ignores a per-query constant)."""
    if name.endswith("attention.self.key.bias"):  # BERT
        return slice(None)
    if name.endswith(("attn.c_attn.bias", "self_attn.in_proj_bias",
                      "multihead_attn.in_proj_bias")):  # q|k|v (the last: nn.Transformer's cross-attention)
        third = param.shape[0] // 3
        return slice(third, 2 * third)
    return None


THIRD_PARTY_MODELS: dict[str, ModelEntry] = {
    "hf_gpt2": ModelEntry(build=_gpt2, batch=_gpt2_batch, loss_fn=_hf_loss, zero_gradient=_key_bias),
    # GPT2Config's own dropout (0.1 on embeddings, attention and residuals)
    "hf_gpt2_dropout": ModelEntry(build=lambda: _gpt2(0.1), batch=_gpt2_batch, loss_fn=_hf_loss,
                                  zero_gradient=_key_bias),
    # grouped-query attention, rotary embeddings, RMSNorm, gated MLP: today's decoder layout
    "hf_llama": ModelEntry(build=_llama, batch=_gpt2_batch, loss_fn=_hf_loss),
    "hf_lora_llama": ModelEntry(build=_lora_llama, batch=_gpt2_batch, loss_fn=_hf_loss),
    # a mixture of experts: each rank's tokens pick other experts
    "hf_gpt_oss": ModelEntry(build=_gpt_oss, batch=_gpt2_batch, loss_fn=_hf_loss),
    "hf_bert": ModelEntry(build=_bert, batch=_bert_batch, loss_fn=_hf_loss, zero_gradient=_key_bias),
    "hf_t5": ModelEntry(build=_t5, batch=_t5_batch, loss_fn=_hf_loss, zero_gradient=_key_bias),
    "torch_encoder": ModelEntry(build=_encoder, batch=_encoder_batch, loss_fn=_encoder_loss,
                                zero_gradient=_key_bias),
    "torch_recurrent": ModelEntry(build=_Recurrent, batch=_recurrent_batch,
                                  loss_fn=_recurrent_loss),
    "torch_causal_lm": ModelEntry(build=_CausalLM, batch=_causal_lm_batch,
                                  loss_fn=_causal_lm_loss, zero_gradient=_key_bias),
    "torch_seq2seq": ModelEntry(build=_Seq2Seq, batch=_seq2seq_batch, loss_fn=_seq2seq_loss,
                                zero_gradient=_key_bias),
}
