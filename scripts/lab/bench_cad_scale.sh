#!/usr/bin/env bash
# CAD's per-server balance in kernel time at W = 8, 16 and 64, emulated, in one call: CAD on the kernel's launch cost
# model at eps 0.01 (fitted first, once, into the cache the runs read; a cached model fitted on another grid, call
# set or merge is fitted again), on
# 1. W = 8 and 16: ProLong, Pretrain and SFT at 256K tokens (SEEDS_W16);
# 2. W = 64: SFT and Pretrain at 512K tokens and ProLong at 128K (SEEDS), every seed's kernel calls dumped;
# then the fitted model (with every call its fit timed) and the dumps copied to $OUT.
# Each run emulates every rank on one GPU; on a machine of several GPUs the runs go round-robin over them, each
# GPU's one after the other, the GPUs side by side (about 8 minutes on one H200; on four, 1 minute at REPS=2; on
# two, 2.5 minutes at REPS=4). Pretrain 512K at W = 64, seed 1, does not fit one H200: it runs again with its
# buffers staged on the host (bench_emulated.py), which took 4.2 minutes alone at 2 repetitions.
#
#   SEEDS="0 1 2" SEEDS_W16=0 REPS=2 OUT=bench/logs scripts/lab/bench_cad_scale.sh
#
# Writes $OUT/cad_scale_w8_w16_seed$S.md, $OUT/cad_scale_w64_seed$S.md, $OUT/cad_scale_launch_model.json and
# $OUT/cad_scale_w64_dumps.tgz.
set -uo pipefail
source "$(dirname "$0")/../bench_env.sh"
SEEDS=${SEEDS:-0 1 2}
SEEDS_W16=${SEEDS_W16:-0}
GPUS=${GPUS:-$($PY -c "import torch; print(max(torch.cuda.device_count(), 1))")}
work=$(mktemp -d)
fit_launch_model "$OUT/cad_scale_launch_model.json"
runs=()
for s in $SEEDS_W16; do
  runs+=("cad_emulated $OUT/cad_scale_w8_w16_seed$s.md --mixes sft,prolong,pretrain \
--tokens prolong:256k,pretrain:256k,sft:256k --worlds 8,16 --budget-s 300 --seed $s")
done
for s in $SEEDS; do runs+=("cad_w64 $s $OUT/cad_scale_w64_seed$s.md $work/s$s"); done
for ((g = 0; g < GPUS; g++)); do  # GPU g runs every GPUS-th run, one after the other, beside the other GPUs
  (export CUDA_VISIBLE_DEVICES=$g; for ((i = g; i < ${#runs[@]}; i += GPUS)); do eval "${runs[i]}"; done) &
done
wait
tar czf "$OUT/cad_scale_w64_dumps.tgz" -C "$work" .
