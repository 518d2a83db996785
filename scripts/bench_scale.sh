#!/usr/bin/env bash
# The scale measurements on a 2-GPU machine, one part per call (each fits the 10-minute command limit):
#
#   scripts/bench_scale.sh smoke       # torch CP peer and checkpoint offload run at all (small model)
#   scripts/bench_scale.sh offload     # 1 GPU: offload vs not, step time / peak memory / gradients
#   scripts/bench_scale.sh curves      # 2 GPUs: bf16 loss curves, every backend and the peer, 50 steps
#   scripts/bench_scale.sh maxctx      # 1 GPU: full Llama-3-8B shape with offload (SEQS="262144 ...")
#   scripts/bench_scale.sh throughput  # 2 GPUs: tokens/s, MFU, memory at 128K, ours and the peer
#
# Logs go to $OUT (or bench/logs). Every number printed is copied into a dated
# file of bench/results/ (indexed in bench/RESULTS.md) with the date.
set -uo pipefail
source "$(dirname "$0")/bench_env.sh"
BACKENDS=${BACKENDS-ring zigzag distflash ulysses tasp cad}  # set empty for the peer alone
train() { $PY scripts/bench_train.py "$@" 2>&1 | grep -E "^(RESULT|CURVE)|Error|error:|out of memory" | tail -5; }

case "${1:-}" in
smoke)
  for b in zigzag torch_cp; do
    train --gpus 2 --model small --layers 2 --seq 4096 --backend $b --mix one --steps 1 --offload
    train --gpus 2 --model small --layers 2 --seq 4096 --backend $b --mix one --steps 1 --tiled-loss 1024
  done
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
  # one step of the full 8B shape at 256K takes ~100 s; 512K takes over 4 minutes a step
  for seq in ${SEQS-262144}; do
    CUDA_VISIBLE_DEVICES=0 train --gpus 1 --backend local --layers 32 --seq $seq --checkpointing layer --offload \
      --tiled-loss 8192 --tiled-mlp 16384 --steps 1
  done
  ;;
throughput)
  # 128K context: packed ProLong mix (tiled loss), then one document against the peer (whole-shard
  # logits: the peer fails with the tiled loss)
  for b in zigzag cad; do train --gpus 2 --seq 65536 --layers 4 --backend $b --tiled-loss 8192 --steps 1; done
  for b in zigzag torch_cp; do train --gpus 2 --seq 65536 --layers 4 --backend $b --mix one --steps 1; done
  ;;
*)
  echo "usage: $0 smoke|offload|curves|maxctx|throughput" >&2
  exit 2
  ;;
esac
