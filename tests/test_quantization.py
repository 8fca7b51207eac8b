"""Quantization-aware training (``torch.ao.quantization.prepare_qat``) through the compile door:
its buffers are resized by the step (a per-channel observer's min/max start empty; FakeQuantize's
scale grows from one element to one per channel on the first step), inside torch's fused
observer op, where the trace's check for an in-place ``resize_`` does not see it.

The compile door wrote such a buffer back with ``copy_`` into its old shape: the first call
failed in the write-back after the graph had already updated the parameters. The write-back
now resizes the buffer, as eager leaves it, and the changed shape retraces the next call.
The Dynamo door trains QAT (and QAT with a fused Conv-BN) too, its gradients reduced as eager
gradients are.
"""

from __future__ import annotations

import pytest
import torch
import torch.ao.quantization as tq
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import spmd_backend
from spmd_backend import DataParallel
from spmd_backend.testing.steps import train_step


def _qat_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(tq.QuantStub(), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4),
                          tq.DeQuantStub())
    model.train()
    model.qconfig = tq.get_default_qat_qconfig("fbgemm")
    return tq.prepare_qat(model)


def test_qat_buffers_keep_their_objects_and_the_step_retraces_once(fake_pg):
    """One process: FakeQuantize's scale and the per-channel observers' min/max are resized by
    torch's fused observer op inside the step (not by a ``resize_`` the trace could refuse)."""
    model, twin = _qat_model(), _qat_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    twin_opt = torch.optim.Adam(twin.parameters(), lr=0.01)
    buffers = dict(model.named_buffers())
    step = spmd_backend.compile(parallel_mode=DataParallel(reduce_op="sum"))(train_step)
    for i in range(3):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(i)) * (1 + i)
        step(model, opt, x)
        train_step(twin, twin_opt, x)
    assert buffers["1.weight_fake_quant.scale"].shape == (32,)
    for (name, a), (_, b) in zip(model.named_buffers(), twin.named_buffers()):
        assert a is buffers[name], name
        torch.testing.assert_close(a, b, msg=name)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)
    assert step.trace_count == 2  # the first shapes' graph, then the resized buffers'


def _qat_job(rank: int, world_size: int) -> dict[str, float]:
    model, ref = _qat_model(), _qat_model()
    ddp = DDP(ref)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    step = spmd_backend.compile(parallel_mode=DataParallel(reduce_op="avg"))(train_step)
    gen = torch.Generator().manual_seed(100 + rank)
    for i in range(4):
        x = torch.randn(8, 16, generator=gen) * (1 + i)  # the observed ranges grow
        step(model, opt, x)
        train_step(ddp, ref_opt, x)
    out = {"trace_count": float(step.trace_count)}
    for (name, a), (_, b) in zip(list(model.named_parameters()) + list(model.named_buffers()),
                                 list(ref.named_parameters()) + list(ref.named_buffers())):
        assert a.shape == b.shape, (name, a.shape, b.shape)
        out[name] = float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
    dist.barrier()
    return out


def test_quantization_aware_training_matches_ddp(rank_pool):
    for result in rank_pool.run(_qat_job):
        assert result.pop("trace_count") == 2
        worst = max(result, key=result.get)
        assert result[worst] < 1e-5, (worst, result[worst])


def _qat_conv_bn_model() -> nn.Module:
    """A convolution, BatchNorm and ReLU fused for QAT (``fuse_modules_qat``), then a head."""
    torch.manual_seed(0)
    model = nn.Sequential(tq.QuantStub(), nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Flatten(), nn.Linear(8 * 6 * 6, 4), tq.DeQuantStub())
    model.train()
    model.qconfig = tq.get_default_qat_qconfig("fbgemm")
    return tq.prepare_qat(tq.fuse_modules_qat(model, [["1", "2", "3"]]))


def _qat_dynamo_job(rank: int, world_size: int, conv: bool) -> dict[str, float]:
    """4 Adam steps through ``backend="spmd"`` and DDP: each parameter's largest difference on
    this rank, each buffer's from DDP's rank 0 (what DDP's next forward broadcasts)."""
    torch._dynamo.reset()
    build = _qat_conv_bn_model if conv else _qat_model
    model, ref = build(), build()
    ddp = DDP(ref)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    step = torch.compile(train_step, backend="spmd", options={"inductor": False})
    gen = torch.Generator().manual_seed(100 + rank)
    for i in range(4):
        shape = (4, 3, 8, 8) if conv else (8, 16)
        x = torch.randn(*shape, generator=gen) * (1 + i)
        step(model, opt, x)
        train_step(ddp, ref_opt, x)
    out = {}
    for (name, a), (_, b) in zip(model.named_parameters(), ref.named_parameters()):
        out[name] = float((a - b).abs().max())
    for (name, a), (_, b) in zip(model.named_buffers(), ref.named_buffers()):
        first = b.clone()
        dist.broadcast(first, 0)
        assert a.shape == first.shape, (name, a.shape, first.shape)
        out[name] = float((a.double() - first.double()).abs().max()) if a.numel() else 0.0
    dist.barrier()
    return out


@pytest.mark.parametrize("conv", [False, True], ids=["linear", "conv_bn"])
def test_quantization_aware_training_through_dynamo_matches_ddp(rank_pool, conv):
    """Dynamo does not compile torch's fake-quantize functions: every parameter's gradient is
    computed eagerly, and the compiled graphs of the step (the loss's) have no parameter.
    Until 2026-11-28 that backward was taken for one run outside the step (no per-graph check
    had opened the eager-gradient session) and refused; a graph without parameters now runs
    the check too, and the eager gradients are reduced as DDP reduces them."""
    for result in rank_pool.run(_qat_dynamo_job, conv):
        worst = max(result, key=result.get)
        assert result[worst] < 1e-5, (worst, result[worst])
