#!/usr/bin/env bash
# The memory planner on one GPU: the full Llama-3-8B shape (32 layers, ProLong mix), each size planned by
# `--memory auto` and run, its predicted GPU and host peaks printed beside the measured ones. One part per
# call (each fits the 10-minute command limit):
#
#   scripts/bench_memory.sh 128k    # today's hand-picked settings, --memory auto, two hand-picked with Liger
#   scripts/bench_memory.sh auto 262144   # --memory auto at the sizes named (tokens per GPU)
#   scripts/bench_memory.sh plans   # the planner's verdict (no run) from 64K to 1M on this GPU
#   scripts/bench_memory.sh kernel fa4 131072 262144   # --memory auto on one kernel, each layer's peak beside the
#                                                      # plan's (the planner's check per kernel)
#   scripts/bench_memory.sh layers torch_flash   # the hand-set two-layer runs of tests/memory_measurements.json
#                                                # again with this code: each layer's measured peak, to set beside the
#                                                # model as tests/test_memory_plan.py does
#
# HF_LONGCTX_HOST_MEMORY_GIB tells the planner the host's memory where /proc/meminfo under-reports it.
# Every number printed is copied into a dated file of bench/results/ (indexed in bench/RESULTS.md) with the date,
# GPU and command.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=${PYTHONPATH:-}:$PWD
PY=${PY:-python3}
STEPS=${STEPS:-2}
WARMUP=${WARMUP:-1}  # 0 at sizes whose step takes minutes: the one step is timed, first-call costs included
# (AdamW's states are allocated before it, so its memory is every step's). LAYER_PEAKS=1: each decoder
# layer's measured peak beside the plan's prediction, the memory model's check layer by layer.
PEAKS=${LAYER_PEAKS:+--layer-peaks}
train() { $PY scripts/bench_train.py --gpus 1 --backend local --layers 32 --steps "$STEPS" --warmup "$WARMUP" $PEAKS "$@" 2>&1 \
  | grep -E "^(RESULT|memory plan|  )|Error|error:|out of memory" | tail -14; }

case "${1:-}" in
128k)  # today's hand-picked settings, --memory auto, then the hand-picked candidates for the fastest
  train --seq 131072 --checkpointing layer --offload --tiled-loss 8192 --tiled-mlp 16384
  train --seq 131072 --memory auto
  train --seq 131072 --checkpointing recompute_aware --offload --tiled-loss 8192 --fused-ops liger
  train --seq 131072 --checkpointing recompute_aware --offload --tiled-loss 8192 --tiled-mlp 16384 --fused-ops liger
  ;;
auto)
  shift
  for seq in "${@:-262144}"; do
    train --seq "$seq" --memory auto
  done
  ;;
kernel)
  kernel=${2:?usage: $0 kernel KERNEL SEQ...}
  shift 2
  for seq in "${@:-131072}"; do
    train --seq "$seq" --memory auto --kernel "$kernel" --layer-peaks
  done
  ;;
layers)  # the hand-set two-layer runs of tests/memory_measurements.json ("runs"), 8B-shaped layers, one kernel
  kernel=${2:-torch_flash}
  for run in "196608 --checkpointing recompute_aware --offload --tiled-mlp 16384 --fused-ops liger" \
             "65536 --checkpointing recompute_aware --offload --tiled-mlp 16384 --fused-ops liger" \
             "196608 --checkpointing recompute_aware --offload --tiled-mlp 16384 --fused-ops off" \
             "196608 --checkpointing recompute_aware --offload --tiled-mlp 0 --fused-ops liger" \
             "196608 --checkpointing layer --tiled-mlp 16384 --fused-ops liger"; do
    # shellcheck disable=SC2086  # the run's options are words
    $PY scripts/bench_train.py --gpus 1 --backend local --layers 2 --steps 1 --warmup 0 --layer-peaks --tiled-loss 2048 \
      --kernel "$kernel" --seq $run 2>&1 | grep -E "^RESULT|Error|error:|out of memory" | tail -3
  done
  ;;
plans)
  for seq in 65536 131072 262144 393216 524288 1048576; do
    $PY - "$seq" <<'PY'
import sys
from transformers import LlamaConfig
from hf_longctx.hf.memory.search import MemoryPlanError, plan_memory
cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8)
try:
    print(plan_memory(cfg, int(sys.argv[1])))
except MemoryPlanError as err:
    print(f"{int(sys.argv[1]) // 1024}K: {err}")
PY
  done
  ;;
*)
  echo "usage: $0 128k | auto SEQ... | kernel KERNEL SEQ... | layers [KERNEL] | plans" >&2
  exit 2
  ;;
esac
