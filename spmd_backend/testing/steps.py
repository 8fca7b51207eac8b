"""The canonical train step of the tests, tools and docs: mean-square loss, backward, optimizer
step, zero_grad, return the loss (the README's step)."""

from __future__ import annotations

import torch
import torch.nn as nn


def train_step(model: nn.Module, optim: torch.optim.Optimizer, batch: torch.Tensor) -> torch.Tensor:
    loss = model(batch).pow(2).mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def amp_step(device_type: str, dtype: torch.dtype,  # type: ignore[no-untyped-def]
             clip_norm: float | None = None, micro_batches: int = 1):
    """:func:`train_step` as AMP users write it, for one device type and autocast dtype:
    ``step(model, optim, batch, scaler)`` with the loss under ``torch.autocast`` and a
    ``torch.amp.GradScaler`` scaling the backward, stepping and updating. With ``clip_norm``:
    torch's recipe for clipping under AMP (``scaler.unscale_(optim)``, then
    ``clip_grad_norm_``, before ``scaler.step``). With ``micro_batches``: the batch's chunks
    accumulated by one scaled backward each, the loss divided by their number."""

    def amp_train_step(model: nn.Module, optim: torch.optim.Optimizer, batch: torch.Tensor,
                       scaler: torch.amp.GradScaler) -> torch.Tensor:
        for chunk in batch.chunk(micro_batches):
            with torch.autocast(device_type, dtype=dtype):
                loss = model(chunk).float().pow(2).mean() / micro_batches
            scaler.scale(loss).backward()
        if clip_norm is not None:
            scaler.unscale_(optim)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
        scaler.step(optim)
        scaler.update()
        optim.zero_grad()
        return loss

    return amp_train_step


def compiled_by(door: str, step, *, reduce_op: str = "sum"):  # type: ignore[no-untyped-def]
    """``step`` compiled by one front door, without Inductor: ``"compile"`` is
    ``spmd_backend.compile`` with ``DataParallel(reduce_op=...)`` (its default passes),
    ``"dynamo"`` is ``torch.compile(step, backend="spmd")`` with the same reduction."""
    if door == "compile":
        import spmd_backend

        return spmd_backend.compile(parallel_mode=spmd_backend.DataParallel(reduce_op=reduce_op))(step)
    if door == "dynamo":
        return torch.compile(step, backend="spmd", options={"inductor": False, "reduce_op": reduce_op})
    raise ValueError(f"unknown door {door!r}: 'compile' or 'dynamo'")
