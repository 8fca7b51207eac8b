#!/usr/bin/env bash
# The GPU record (docs/benchmarks.md, "One H100 GPU"): run on a lent GPU machine from the
# repository root, results under ${OUT:-out/gpu}. The device image's torch (2.11 when this was
# written) lacks torch.compiler._non_strict_tracing_context, which torch 2.13 uses to let
# torch.utils.checkpoint trace like eager, and torch._inductor.custom_graph_pass.
# get_custom_graph_passes, which the lowering reads Inductor's pass settings with; every process
# here gets stand-ins (sitecustomize: the first does nothing, the second does what 2.13's does),
# so everything but checkpointed steps traces and lowers as on 2.13. Not used by CI.
#   tools/gpu_run.sh check|bench|memory|all
#   (WORKLOADS="mlp hf_gpt2", BENCH_STEPS=30, CHECK_PARTS="parity amp dropout dtypes schedules checkpoint",
#    MODES="fx inductor shard bf16" by default)
set -uo pipefail
out=${OUT:-out/gpu}
workloads=${WORKLOADS:-mlp hf_gpt2}
mkdir -p "$out" /tmp/spmd_shim
cat > /tmp/spmd_shim/sitecustomize.py <<'PY'
import contextlib

import torch

if not hasattr(torch.compiler, "_non_strict_tracing_context"):
    torch.compiler._non_strict_tracing_context = contextlib.nullcontext

if torch.__version__ < "2.13":  # the lowering reads Inductor's pass settings through this
    import torch._inductor.custom_graph_pass as _passes

    if not hasattr(_passes, "get_custom_graph_passes"):
        def get_custom_graph_passes(value):
            if value is None:
                return ()
            return tuple(value) if isinstance(value, (list, tuple)) else (value,)

        _passes.get_custom_graph_passes = get_custom_graph_passes
PY
export PYTHONPATH=/tmp/spmd_shim PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/spmd_inductor}
what=${1:-all}
if [ "$what" = all ] || [ "$what" = bench ]; then
  # shellcheck disable=SC2086
  timeout 300 python3 tools/bench.py --ranks 1 --no-trace --workloads $workloads \
    --variants ddp ddp_compiled spmd_opt_inductor spmd_shard ddp_bf16 spmd_bf16 --steps "${BENCH_STEPS:-30}" \
    --out "$out/bench.json" --md "$out/bench.md" > "$out/bench.log" 2>&1
  echo "bench rc=$?"; cat "$out/bench.md"
fi
if [ "$what" = all ] || [ "$what" = memory ]; then
  # shellcheck disable=SC2086
  timeout 200 python3 tools/bench.py --ranks 1 --no-trace --no-steps --workloads $workloads \
    --memory ddp spmd_opt_inductor spmd_bf16 \
    --out "$out/memory.json" --md "$out/memory.md" > "$out/memory.log" 2>&1
  echo "memory rc=$?"; cat "$out/memory.md"
fi
if [ "$what" = all ] || [ "$what" = check ]; then
  # shellcheck disable=SC2086
  timeout 330 python3 tools/gpu_check.py --workloads $workloads --out "$out/gpu_check.json" \
    --parts ${CHECK_PARTS:-parity amp dropout dtypes schedules checkpoint} --modes ${MODES:-fx inductor shard bf16} \
    > "$out/gpu_check.log" 2>&1
  echo "gpu_check rc=$?"; grep -E "^(mlp|hf_gpt2|eager|compiled|amp|dropout|dtypes|schedules)/|^wrote|^\{" "$out/gpu_check.log" | cut -c1-400
fi
