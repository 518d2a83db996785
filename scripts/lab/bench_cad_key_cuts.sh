#!/usr/bin/env bash
# What key cuts buy CAD, emulated on one GPU: the same batches scheduled with and without them (a task's first
# keys given away as a rectangle, see hf_longctx.backends.cad.tasks), CAD on the launch cost model at eps 0.01.
# PART=w64: Pretrain and SFT at 512K tokens and ProLong at 128K, W = 64; PART=w8_w16: ProLong and Pretrain at
# 256K, W = 8 and 16 (each part one call of about 5-8 minutes on an H100 or H200); PART=w64_long: ProLong at 256K,
# then Pretrain at 512K if the budget is left, W = 64, every rank's all_to_all buffers on the host
# (bench_emulated.py --stage-on-host: 64 ranks' gathered rows and returned fp32 gradients do not fit on one device
# together). Staged, ProLong 256K took 4.6-6.4 minutes on an H200, mostly host copies outside the timed calls: one
# seed per call (SEEDS=0).
#
#   PART=w64 OUT=bench/logs scripts/lab/bench_cad_key_cuts.sh
#
# RUNS="cad profiled eps0.01" runs CAD with key cuts alone. Writes $OUT/cad_key_cuts_seed{0,1,2}_$PART.md.
set -uo pipefail
source "$(dirname "$0")/../bench_env.sh"
REPS=${REPS:-3}
SEEDS=${SEEDS:-0 1 2}
PART=${PART:-w64}
RUNS=${RUNS:-cad profiled eps0.01,cad profiled eps0.01 no key cuts}
common=(--kernel torch_flash --backends cad --eps-sweep none:0 --reps "$REPS" --cad-runs "$RUNS")
for s in $SEEDS; do
  if [ "$PART" = w64_long ]; then
    $PY scripts/lab/bench_emulated.py "${common[@]}" --mixes prolong,pretrain --stage-on-host \
      --tokens prolong:256k,pretrain:512k --worlds 64 --budget-s 170 --seed "$s" \
      --out "$OUT/cad_key_cuts_seed${s}_$PART.md" | grep -E "\| cad "
  elif [ "$PART" = w64 ]; then
    $PY scripts/lab/bench_emulated.py "${common[@]}" --mixes pretrain,sft,prolong \
      --tokens pretrain:512k,sft:512k,prolong:128k --worlds 64 --budget-s 170 --seed "$s" \
      --out "$OUT/cad_key_cuts_seed${s}_$PART.md" | grep -E "\| cad "
  else
    $PY scripts/lab/bench_emulated.py "${common[@]}" --mixes prolong,pretrain --worlds 8,16 --budget-s 150 --seed "$s" \
      --out "$OUT/cad_key_cuts_seed${s}_$PART.md" | grep -E "\| cad "
  fi
done
