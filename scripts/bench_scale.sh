#!/usr/bin/env bash
# The scale measurements on a 2-GPU machine, one part per call (each fits the 10-minute command limit):
#
#   scripts/bench_scale.sh smoke       # torch CP peer and checkpoint offload run at all (tiny model)
#   scripts/bench_scale.sh offload     # 1 GPU: offload vs not, step time / peak memory / gradients
#   scripts/bench_scale.sh curves      # 2 GPUs: bf16 loss curves, every backend and the peer, 50 steps
#   scripts/bench_scale.sh maxctx      # 1 GPU: full Llama-3-8B shape at 512K tokens with offload
#   scripts/bench_scale.sh throughput  # 2 GPUs: tokens/s, MFU, memory per backend and the peer, 128K and 512K
#
# Logs go to $OUT (or bench/logs). Every number printed is copied into bench/RESULTS.md with the date.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/logs}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-}:$PWD
PY=${PY:-python3}
BACKENDS=${BACKENDS:-ring zigzag distflash ulysses tasp cad}
train() { $PY scripts/bench_train.py "$@" 2>&1 | grep -E "^(RESULT|CURVE)|Error|error:|out of memory" | tail -5; }

case "${1:-}" in
smoke)
  for b in zigzag torch_cp; do train --quick --gpus 2 --backend $b --mix one --steps 1 --offload; done
  train --quick --gpus 2 --backend torch_cp --mix one --steps 1 --tiled-loss 512
  ;;
offload)
  CUDA_VISIBLE_DEVICES=0 $PY scripts/bench_checkpointing.py --layers 8 --seqs 65536 --tiled-loss 8192 --reps 2 \
    --modes layer,layer+offload,recompute_aware,recompute_aware+offload 2>&1 | grep -v Warning
  ;;
curves)
  for b in $BACKENDS torch_cp; do
    train --gpus 2 --model small --layers 4 --vocab 32000 --seq 8192 --mix one --backend $b --curve 50 --lr 1e-3
  done
  ;;
maxctx)
  for seq in 524288 393216; do
    r=$(train --gpus 1 --backend local --layers 32 --seq $seq --checkpointing layer --offload \
          --tiled-loss 8192 --tiled-mlp 16384 --steps 1)
    echo "$r"
    echo "$r" | grep -q RESULT && break
  done
  ;;
throughput)
  for seq in 65536 262144; do
    for b in zigzag distflash ulysses cad; do train --gpus 2 --seq $seq --layers 4 --backend $b --tiled-loss 8192 --steps 2; done
    for b in zigzag cad torch_cp; do
      train --gpus 2 --seq $seq --layers 4 --backend $b --mix one --tiled-loss 8192 --steps 2
    done
  done
  ;;
*)
  echo "usage: $0 smoke|offload|curves|maxctx|throughput" >&2
  exit 2
  ;;
esac
