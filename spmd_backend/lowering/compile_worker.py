"""The background compile worker: ``python -m spmd_backend.lowering.compile_worker PAYLOAD``.

Requires: a payload written by :mod:`spmd_backend.lowering.background` (a flat step graph
serialized by :mod:`spmd_backend.graph.serialize`, descriptions of its inputs, the rank and size of each process group its collectives
name, the parent's Inductor and AOTAutograd configuration and the process-wide settings
Inductor's cache key reads: threads, grad mode, deterministic algorithms, default dtype, matmul
precision) and the parent's ``TORCHINDUCTOR_CACHE_DIR``. Guarantees: compiles the graph with Inductor exactly as the parent
would (same configuration, fake inputs with the same metadata, a fake process group registered
under each group name, so nothing is communicated) and exits 0, leaving the compiled graph in
the shared cache; on any error it prints the error and exits 1. Either way it writes its exit
status to ``PAYLOAD.done`` last (what ranks that share this worker's result wait for: see
:mod:`spmd_backend.lowering.background`). It never touches real data.
"""

from __future__ import annotations

import os
import pickle
import sys
from typing import Any


def tensor_spec(t: Any) -> tuple[Any, ...]:
    """A tensor's picklable description: ``("tensor", shape, stride, storage offset, dtype,
    device, requires_grad)`` (static shapes)."""
    return ("tensor", tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype,
            str(t.device), t.requires_grad)


def fake_tensor(spec: tuple[Any, ...], fake_mode: Any) -> Any:
    """A fake tensor of ``fake_mode`` as :func:`tensor_spec` describes it (made from a meta
    tensor directly, without a dispatch through the mode)."""
    import torch

    _, shape, stride, offset, dtype, device, requires_grad = spec
    extent = offset + sum((n - 1) * s for n, s in zip(shape, stride)) + 1 if all(shape) else 0
    base = torch.empty_strided((extent,), (1,), dtype=dtype, device="meta")
    meta = base.as_strided(shape, stride, offset) if all(shape) else torch.empty_strided(
        shape, stride, dtype=dtype, device="meta")
    fake = fake_mode.fake_tensor_converter.from_meta_and_device(
        fake_mode, meta, torch.device(device))
    return fake.requires_grad_(requires_grad) if requires_grad else fake


def fake_inputs(specs: list[Any]) -> list[Any]:
    """Fake tensors (in a new fake mode with a shape env) as the specs describe them."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv())
    return [spec[1] if spec[0] == "value" else fake_tensor(spec, mode) for spec in specs]


def _apply_process_state(state: dict[str, Any]) -> None:
    import torch

    torch.set_num_threads(state["num_threads"])
    torch.set_grad_enabled(state["grad_enabled"])
    enabled, warn_only, fill = state["deterministic"]
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    torch.utils.deterministic.fill_uninitialized_memory = fill  # type: ignore[attr-defined]
    torch.set_default_dtype(state["default_dtype"])
    matmul = torch.backends.cuda.matmul
    (matmul.fp32_precision, matmul.allow_fp16_reduced_precision_reduction,
     matmul.allow_bf16_reduced_precision_reduction) = state["matmul"]
    if state["cuda_device"] is not None:
        torch.cuda.set_device(state["cuda_device"])


def _register_groups(groups: dict[str, tuple[int, int]]) -> None:
    """A fake process group under each name (group names are what the graph refers to)."""
    if not groups:
        return
    import torch.distributed as dist
    from torch._C._distributed_c10d import _register_process_group
    from torch.distributed.distributed_c10d import _resolve_process_group
    from torch.testing._internal.distributed.fake_pg import FakeStore

    rank = groups[next(iter(groups))][0]
    world = max(n for _, n in groups.values())
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    for name, (r, n) in groups.items():
        try:
            if _resolve_process_group(name).size() == n:
                continue
        except (RuntimeError, ValueError):
            pass
        # a group of the graph's size under the graph's name (nothing is communicated)
        pg = dist.new_group(ranks=list(range(n))) if r < n else None
        if pg is None:
            raise RuntimeError(f"group {name}: rank {r} outside size {n}")
        if pg.group_name != name:
            _register_process_group(name, pg)


def main(path: str) -> int:
    import torch
    import torch._inductor.inductor_prims  # noqa: F401 - prims Inductor's decompositions emit
    import torch.distributed  # noqa: F401 - registers the functional collectives
    from torch._inductor.compile_fx import compile_fx

    import spmd_backend.lowering.fused_decomp  # noqa: F401 - registers the graph's custom ops
    from spmd_backend.graph import serialize
    from spmd_backend.lowering.handover import stable_cache_keys
    from spmd_backend.lowering.inductor import step_graph_config

    stable_cache_keys()  # the same cache keys as the training process

    with open(path, "rb") as f:
        payload = pickle.load(f)  # noqa: S301 - our own file, written by the parent
    torch._inductor.config.load_config(payload["inductor_config"])
    torch._functorch.config.load_config(payload["functorch_config"])
    _apply_process_state(payload["process_state"])
    _register_groups(payload["groups"])

    gm = serialize.load(payload["gm"])
    with step_graph_config(gm.graph):  # as the training process compiles
        compile_fx(gm, fake_inputs(payload["inputs"]))
    return 0


def write_done(path: str, status: int) -> None:
    """``PAYLOAD.done`` holding ``status``, written whole (renamed into place)."""
    with open(path + ".done.tmp", "w") as f:
        f.write(str(status))
    os.replace(path + ".done.tmp", path + ".done")


if __name__ == "__main__":
    status = 1
    try:
        status = main(sys.argv[1])
    except Exception as e:  # noqa: BLE001 - the parent reads the last line
        import traceback

        traceback.print_exc()
        print(f"{type(e).__name__}: {e}".replace("\n", " ")[:2000], flush=True)
    finally:
        write_done(sys.argv[1], status)
    sys.exit(status)
