"""Train a small GPT on synthetic data with spmd_backend.compile, side by side with DDP.

Launch (what `make demo` does):

    torchrun --standalone --nproc_per_node 2 examples/train_transformer.py

Each rank draws its own synthetic token batches. The compiled step (graph optimization +
Inductor, ``reduce_op="avg"``, i.e. DDP's mean) and a DDP copy of the same model train side by
side; Inductor compiles in a background process while the fx graph trains, and every rank switches
to Inductor's code on the same step (the table's medians are over the steps after it). Rank 0 shows a progress bar with the loss and both step times; at the end it prints a
small benchmark table (median step times, ratio, first-call compile time, largest parameter
difference to DDP) and writes ``out/demo/timeline.png`` (one profiled step of each) and
``out/demo/bench.md``.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import spmd_backend
from spmd_backend.gm_transformation import GraphModuleTransformation
from spmd_backend.lowering import pending
from spmd_backend.testing.models import GPT


def lm_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def train_step(model, optim, batch):
    loss = lm_loss(model, batch)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def synthetic_batch(gen: torch.Generator, args: argparse.Namespace, device: torch.device):
    # a learnable stream: token t+1 = (3 * token t + 1) mod vocab, from random starts
    tokens = torch.randint(0, args.vocab, (args.batch, 1), generator=gen)
    seq = [tokens]
    for _ in range(args.seq - 1):
        tokens = (tokens * 3 + 1) % args.vocab
        seq.append(tokens)
    return torch.cat(seq, dim=1).to(device)


def progress(i: int, total: int, loss: float, spmd_ms: float, ddp_ms: float) -> None:
    width = 30
    done = int(width * (i + 1) / total)
    line = (f"[{'#' * done}{'.' * (width - done)}] {i + 1:4d}/{total} loss {loss:7.4f} | "
            f"spmd {spmd_ms:6.1f} ms | ddp {ddp_ms:6.1f} ms")
    if sys.stdout.isatty():
        print("\r" + line, end="" if i + 1 < total else "\n", flush=True)
    elif i == 0 or (i + 1) % max(1, total // 10) == 0:
        print(line, flush=True)


#: steps of Inductor's code the table's medians need; the run is extended until there are as many
MIN_COMPILED_STEPS = 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out", default="out/demo")
    parser.add_argument("--no-inductor", action="store_true")
    parser.add_argument("--no-pictures", action="store_true")
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))

    torch.manual_seed(0)
    model = GPT(vocab=args.vocab, dim=args.dim, heads=args.heads, layers=args.layers, seq=args.seq).to(device)
    ddp_model = DDP(copy.deepcopy(model), device_ids=[device.index] if use_cuda else None)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, fused=True)
    ddp_optim = torch.optim.AdamW(ddp_model.parameters(), lr=args.lr, weight_decay=0.01, fused=True)
    transformation = GraphModuleTransformation(
        enable_graph_optimization=True, enable_inductor=not args.no_inductor
    )
    step = spmd_backend.compile(
        gm_transformation=transformation,
        parallel_mode=spmd_backend.DataParallel(reduce_op="avg"),
    )(train_step)

    gen = torch.Generator().manual_seed(1234 + rank)
    sync = torch.cuda.synchronize if use_cuda else (lambda: None)
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"GPT {args.layers} layers, dim {args.dim}, {n_params / 1e6:.2f}M params, {world} ranks "
              f"({'nccl' if use_cuda else 'gloo'}), batch {args.batch}x{args.seq} per rank, "
              f"{args.steps} steps; spmd = graph optimization{'' if args.no_inductor else ' + Inductor'}",
              flush=True)
    spmd_times, ddp_times, first_calls = [], [], 0.0
    compiled_from: int | None = None  # the first step that ran Inductor's code
    total, i = args.steps, 0
    while i < total:
        if i + 1 == total and (compiled_from is None or total - compiled_from < MIN_COMPILED_STEPS):
            total += 1  # train on until Inductor's code has run MIN_COMPILED_STEPS steps
        batch = synthetic_batch(gen, args, device)
        t0 = time.perf_counter()
        loss = step(model, optim, batch, **({"last_train_step": True} if i == total - 1 else {}))
        sync()
        t1 = time.perf_counter()
        train_step(ddp_model, ddp_optim, batch)
        sync()
        t2 = time.perf_counter()
        if i < 2:
            first_calls += t1 - t0  # the bootstrap, then the steady-state trace and compile
        elif compiled_from is not None:
            spmd_times.append(t1 - t0)
            ddp_times.append(t2 - t1)
        # the step graph's worker starts on step 2 (step 0 creates the optimizer state);
        # pending() is the same on every rank after each step
        if compiled_from is None and i >= 2 and not pending():
            compiled_from = i + 1
        if rank == 0:
            progress(i, total, float(loss), 1e3 * (t1 - t0), 1e3 * (t2 - t1))
        i += 1

    with torch.no_grad():
        max_diff = max(float((p - q).abs().max()) for p, q in zip(model.parameters(), ddp_model.module.parameters()))
    spmd_med = statistics.median(spmd_times) if spmd_times else float("nan")
    ddp_med = statistics.median(ddp_times) if ddp_times else float("nan")
    table = "\n".join([
        "| variant | median step ms | vs DDP | first two calls s |",
        "|---|---|---|---|",
        f"| DDP eager | {1e3 * ddp_med:.1f} | 1.00x | - |",
        f"| spmd_backend.compile | {1e3 * spmd_med:.1f} | {spmd_med / ddp_med:.2f}x | {first_calls:.1f} |",
    ])
    switch = (f"Inductor's code from step {compiled_from} of {total} (the fx graph before it, "
              "while Inductor compiled in the background)")
    pictures = None
    if not args.no_pictures:
        from spmd_backend.viz import profile_step, timeline_png

        batch = synthetic_batch(gen, args, device)
        dist.barrier()
        tl_ddp = profile_step(lambda: train_step(ddp_model, ddp_optim, batch), "DDP eager")
        dist.barrier()
        tl_spmd = profile_step(lambda: step(model, optim, batch), "spmd_backend.compile")
        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            pictures = timeline_png([tl_ddp, tl_spmd], os.path.join(args.out, "timeline.png"))
    if rank == 0:
        print(switch)
        print(table)
        print(f"largest parameter difference vs DDP after {total} steps: {max_diff:.2e}")
        if not args.no_pictures:
            with open(os.path.join(args.out, "bench.md"), "w") as f:
                f.write(table + "\n")
            print(f"wrote {pictures} and {os.path.join(args.out, 'bench.md')}")
    # torch 2.13: loss.backward() stashes a Python object in the thread-local state that the
    # gloo work DDP launches from the backward captures. A gloo worker thread that releases such
    # a work needs the GIL; the group's destructor (here when DDP's reducer goes, as main()
    # returns) joins the workers with the GIL held: a worker still releasing one deadlocks the
    # rank. A barrier alone left that window open (tools/ reproduction in docs/reliability.md);
    # sleeping after it gives the GIL to the workers first.
    dist.barrier()
    time.sleep(0.5)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
