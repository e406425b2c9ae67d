#!/usr/bin/env bash
# Every GPU measurement of issue 57 in one command that fits a 10-minute window on one H200: scoring against TRL
# 1.16 at both shapes (rlft with its Triton kernels and without), the fused head with the loss's closed-form
# gradient in its forward, and the whole GRPO step (LoRA and full) against TRL. Each part has its own time
# limit, so one that runs out still leaves the others' files. After benchmarks/gpu/setup.sh:
#
#   bash benchmarks/gpu/run.sh OUT_DIR GPU_NAME        # e.g. bash benchmarks/gpu/run.sh "$OUT" h200
set -uo pipefail
out="${1:-benchmarks/gpu}"
name="${2:-gpu}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
mkdir -p "$out"
export PYTHONUNBUFFERED=1
status=0
timeout 270 python benchmarks/gpu/bench.py --out "$out/results-$name.md" || status=$?
timeout 100 python benchmarks/gpu/long_fused.py --lengths 8192 --repeats 2 \
    --settings "attention kept" "kept + loss gradient" --out "$out/long-fused-$name.md" || status=$?
timeout 200 python benchmarks/gpu/grpo_step.py --out "$out/grpo-step-$name.md" || status=$?
exit "$status"
