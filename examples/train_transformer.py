"""Train a small GPT on synthetic data with spmd_backend.compile, next to DDP.

Launch (what `make demo` does):

    torchrun --standalone --nproc_per_node 2 examples/train_transformer.py

Each rank draws its own synthetic token batches. The compiled step (``reduce_op="avg"``, i.e.
DDP's mean) and a DDP copy of the same model train side by side; rank 0 prints the loss of both
and both step times every step, then a summary with the median step times and the largest
parameter difference between the two models.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import spmd_backend
from spmd_backend.testing.models import GPT


def lm_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch)
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)
    )


def train_step(model, optim, batch):
    loss = lm_loss(model, batch)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def synthetic_batch(gen: torch.Generator, args: argparse.Namespace, device: torch.device):
    # a learnable stream: token t+1 = (token t * 3 + 1) mod vocab, with random starts
    start = torch.randint(0, args.vocab, (args.batch, 1), generator=gen)
    tokens = start.clone()
    seq = [tokens]
    for _ in range(args.seq - 1):
        tokens = (tokens * 3 + 1) % args.vocab
        seq.append(tokens)
    return torch.cat(seq, dim=1).to(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(0)
    model = GPT(vocab=args.vocab, dim=args.dim, heads=args.heads, layers=args.layers, seq=args.seq).to(device)
    ddp_model = DDP(copy.deepcopy(model), device_ids=[device.index] if use_cuda else None)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, fused=True)
    ddp_optim = torch.optim.AdamW(ddp_model.parameters(), lr=args.lr, weight_decay=0.01, fused=True)

    step = spmd_backend.compile(parallel_mode=spmd_backend.DataParallel(reduce_op="avg"))(train_step)

    gen = torch.Generator().manual_seed(1234 + rank)
    spmd_times, ddp_times = [], []
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"GPT {args.layers} layers, dim {args.dim}, {n_params / 1e6:.2f}M params, "
              f"{world} ranks ({'nccl' if use_cuda else 'gloo'}), batch {args.batch}x{args.seq} per rank")
    for i in range(args.steps):
        batch = synthetic_batch(gen, args, device)
        t0 = time.perf_counter()
        loss = step(model, optim, batch)
        if use_cuda:
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        ddp_loss = train_step(ddp_model, ddp_optim, batch).detach()
        if use_cuda:
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        spmd_times.append(t1 - t0)
        ddp_times.append(t2 - t1)
        if rank == 0:
            note = " (traces the step)" if i < 2 else ""
            print(f"step {i:3d} | loss {float(loss):.4f} (ddp {float(ddp_loss):.4f}) | "
                  f"spmd {1e3 * (t1 - t0):8.1f} ms | ddp {1e3 * (t2 - t1):7.1f} ms{note}", flush=True)

    steady = slice(3, None) if args.steps > 5 else slice(0, None)
    spmd_med = statistics.median(spmd_times[steady])
    ddp_med = statistics.median(ddp_times[steady])
    with torch.no_grad():
        max_diff = max(
            float((p - q).abs().max())
            for p, q in zip(model.parameters(), ddp_model.module.parameters())
        )
    if rank == 0:
        print(f"median steady step: spmd {1e3 * spmd_med:.1f} ms, ddp {1e3 * ddp_med:.1f} ms "
              f"(ratio {spmd_med / ddp_med:.2f}x); first call {spmd_times[0]:.2f} s")
        print(f"largest parameter difference vs DDP after {args.steps} steps: {max_diff:.2e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
