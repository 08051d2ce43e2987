#!/usr/bin/env bash
# One command that proves the GPU path: the seed plan and a bf16 + compile + flex resume
# (bit-equal), async checkpointing with pinned-memory staging, tokens/s, MFU and peak
# memory of 125M and 1B per attention backend, and the GPU-only tests; a markdown table.
#
#   scripts/gpu_check.sh [--budget-s 480] [--json out.json] [--work DIR]
#   scripts/gpu_check.sh --cpu-smoke      # the same plan with tiny shapes on CPU
#
# The plan is torchtitan/tools/gpu_check.py; this script only sets the stage: the repository
# root as the working directory, and no visible GPU for --cpu-smoke.
set -euo pipefail
cd "$(dirname "$0")/.."
for arg in "$@"; do
    if [[ "$arg" == "--cpu-smoke" ]]; then
        export CUDA_VISIBLE_DEVICES=""
    fi
done
exec "${PYTHON:-python}" -m torchtitan.tools.gpu_check "$@"
