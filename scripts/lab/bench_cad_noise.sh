#!/usr/bin/env bash
# How much of CAD's measured per-server imbalance is timing noise, emulated on one GPU, in one call (about 6
# minutes on an H100 or H200). Three batches (seeds) of each mix: Pretrain and SFT at 512K tokens and W = 64,
# ProLong at 256K and W = 8 and 16; CAD on the launch cost model at eps 0.01, and Ulysses at W = 16 (every rank
# computes the same work, so its measured max/mean is a measured noise floor to check the estimate against). Each
# row's notes give the timing noise of one repetition and the max/mean that noise alone gives W equal ranks.
#
#   OUT=bench/logs scripts/lab/bench_cad_noise.sh
#
# Writes $OUT/cad_noise_seed{0,1,2}_*.md.
set -uo pipefail
source "$(dirname "$0")/../bench_env.sh"
REPS=${REPS:-5}
SEEDS=${SEEDS:-0 1 2}
common=(--kernel torch_flash --eps-sweep none:0 --cad-runs "cad profiled eps0.01" --reps "$REPS")
for s in $SEEDS; do
  $PY scripts/lab/bench_emulated.py "${common[@]}" --backends cad --mixes pretrain,sft --tokens pretrain:512k,sft:512k \
    --worlds 64 --budget-s 240 --seed "$s" --out "$OUT/cad_noise_seed${s}_w64.md" | grep -E "\| cad "
  $PY scripts/lab/bench_emulated.py "${common[@]}" --backends cad,ulysses --mixes prolong,pretrain --worlds 8,16 \
    --budget-s 200 --seed "$s" --out "$OUT/cad_noise_seed${s}_w8_w16.md" | grep -E "\| (cad|ulysses) "
done
