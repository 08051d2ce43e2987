#!/usr/bin/env bash
# Launch training with torchrun on one machine.
#   NGPU=2 CONFIG_FILE=train_configs/debug_model.toml ./run_train.sh [--section.key value ...]
# NGPU is the number of processes (GPUs, or CPU ranks on a machine without GPUs).
set -euo pipefail
NGPU=${NGPU:-2}
CONFIG_FILE=${CONFIG_FILE:-train_configs/debug_model.toml}
# One process per core or GPU: more intra-op threads than cores per rank only thrash.
if [ -z "${OMP_NUM_THREADS:-}" ]; then
  cores=$(nproc 2>/dev/null || echo 1)
  OMP_NUM_THREADS=$(( cores / NGPU > 0 ? cores / NGPU : 1 ))
  export OMP_NUM_THREADS
fi
cd "$(dirname "$0")"
exec torchrun --standalone --nproc_per_node="$NGPU" \
  train.py --job.config_file "$CONFIG_FILE" "$@"
