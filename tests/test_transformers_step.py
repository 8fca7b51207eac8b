"""A transformers model in a compiled step as users write it (one process, fake process group):
returning the ``ModelOutput``, a ragged last batch with ``dynamic_batch``, switching gradient
checkpointing on between calls.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import spmd_backend
from spmd_backend.testing.steps import train_step

transformers = pytest.importorskip("transformers")


def gpt2():
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96,
                                     n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def lm_step(model, optim, ids):
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    optim.step()
    optim.zero_grad()
    return out


def test_returning_the_model_output(fake_pg, caplog):
    model = gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    compiled = spmd_backend.compile()(lm_step)
    with caplog.at_level(logging.WARNING, logger="spmd_backend"):
        for _ in range(2):
            out = compiled(model, opt, torch.randint(0, 96, (4, 16)))
    assert type(out).__name__ == "CausalLMOutputWithCrossAttentions"
    assert out.loss.dim() == 0 and out.logits.shape == (4, 16, 96)
    assert out.past_key_values is None
    assert any("DynamicCache at output['past_key_values']" in r.getMessage() for r in caplog.records)


def test_ragged_batches_share_one_symbolic_graph(fake_pg, caplog):
    """GPT-2's causal-LM loss specialised the batch dim while symbolic sizes were traced
    without the Python dispatcher (a graph per size, with a log line); it now keeps one graph."""
    model = gpt2()
    twin = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-3)
    compiled = spmd_backend.compile(dynamic_batch=True)(lm_step)
    gen = torch.Generator().manual_seed(0)
    for size in (4, 4, 3, 4, 3, 5):
        ids = torch.randint(0, 96, (size, 16), generator=gen)
        loss = compiled(model, opt, ids).loss
        torch.testing.assert_close(loss, lm_step(twin, twin_opt, ids).loss)
    assert compiled.cache_size() == 1 and compiled.trace_count == 2  # bootstrap + steady
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)


class _FixedBatch(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.lin(x).reshape(4, -1)  # fixes the batch dim at 4


def test_ragged_batch_with_a_model_that_specialises_the_batch_dim(fake_pg, caplog):
    torch.manual_seed(0)
    model = _FixedBatch()
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    compiled = spmd_backend.compile(dynamic_batch=True)(train_step)
    gen = torch.Generator().manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="spmd_backend"):
        for size in (4, 4, 8, 4, 8):  # the 8s must neither crash nor reuse the size-4 graph
            x = torch.randn(size, 16, generator=gen)
            compiled(model, opt, x)
            train_step(twin, twin_opt, x)
    messages = [r.getMessage() for r in caplog.records]
    assert any("dim 0 of args[2] was marked dynamic, but the step specialised it to 4 at" in m
               for m in messages), messages
    assert compiled.cache_size() == 2  # one graph per size, each guarded on its size
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)


def test_gradient_checkpointing_switched_on_retraces(fake_pg, caplog):
    model = gpt2()
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    compiled = spmd_backend.compile()(lm_step)
    ids = torch.randint(0, 96, (2, 16))
    compiled(model, opt, ids)
    lm_step(twin, twin_opt, ids)
    for m in (model, twin):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with caplog.at_level(logging.WARNING, logger="spmd_backend"):
        loss = compiled(model, opt, ids).loss
    torch.testing.assert_close(loss, lm_step(twin, twin_opt, ids).loss)
    assert any("retracing lm_step: attribute" in r.getMessage() and "gradient_checkpointing" in
               r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    graph = compiled.graph.traced.gm.graph
    assert any(str(n.meta.get("spmd_phase")) == "recompute" for n in graph.nodes)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_gradient_checkpointing_with_dropout_matches_eager(fake_pg, reentrant):
    """The recompute of a checkpointed block must drop out what its forward dropped. The compile
    door drew fresh masks in the recompute (torch's checkpoint restores the generator state, which
    put nothing in the graph): every gradient through a dropout was wrong (tracing.random_state)."""
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96,
                                     n_positions=16, resid_pdrop=0.2, embd_pdrop=0.2,
                                     attn_pdrop=0.2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    compiled = spmd_backend.compile()(lm_step)
    gen = torch.Generator().manual_seed(0)
    for i in range(3):
        ids = torch.randint(0, 96, (2, 16), generator=gen)
        torch.manual_seed(i)
        loss = compiled(model, opt, ids).loss
        torch.manual_seed(i)
        torch.testing.assert_close(loss, lm_step(twin, twin_opt, ids).loss)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)


def test_the_labels_step_is_one_graph_through_dynamo(fake_pg, caplog):
    """``model(input_ids=ids, labels=ids).loss`` through ``backend="spmd"``: transformers'
    ``loss_function`` calls ``logger.warning_once`` when ``config.loss_type`` is unset (every
    model built from a config), a ``logging.Logger`` call Dynamo does not trace: until
    2026-11-28 the step fell back to per-graph mode. The warning is made while tracing (once, as
    eager prints it) and the step is one graph that matches eager, under a warmup schedule that
    starts at lr = 0 (transformers' own)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = gpt2()
    twin = copy.deepcopy(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01) for m in (model, twin)]
    scheds = [transformers.get_linear_schedule_with_warmup(o, 2, 10) for o in opts]
    compiled = torch.compile(lm_step, backend="spmd", options={"inductor": False, "reduce_op": "sum"})
    for i in range(5):
        ids = torch.randint(0, 48, (4, 16), generator=torch.Generator().manual_seed(i))
        compiled(model, opts[0], ids)
        lm_step(twin, opts[1], ids)
        for s in scheds:
            s.step()
    assert counters["spmd"]["per_graph_graphs"] == 0, dict(counters["spmd"])
    assert counters["spmd"]["whole_step_graphs"] == 2, dict(counters["spmd"])  # lr 0, then dynamic
    assert not counters["graph_break"], dict(counters["graph_break"])
    for p, q in zip(model.parameters(), twin.parameters()):
        assert not p.isnan().any()
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
