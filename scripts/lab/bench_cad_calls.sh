#!/usr/bin/env bash
# Where CAD's per-server error at W = 64 comes from, call by call, on one GPU: emulated CAD steps (launch cost model,
# eps 0.01, key cuts) of SFT at 512K and ProLong at 128K tokens dump every kernel call with its time in the step;
# each dump is then timed again call by call alone (forwards also cut into chunks of their keys, as the step ran
# them) and priced by the model the step was scheduled on.
#
#   SEEDS="0 1" OUT=bench/logs scripts/lab/bench_cad_calls.sh
#
# Writes $OUT/cad_calls_seed$S.md (the emulated steps), $OUT/cad_calls_dumps.tgz and
# $OUT/cad_calls_replay_{sft,prolong}_seed$S.log. About 4 minutes on an H200 for two seeds.
set -uo pipefail
source "$(dirname "$0")/../bench_env.sh"
SEEDS=${SEEDS:-0 1}
REPS=${REPS:-3}
work=$(mktemp -d)
for s in $SEEDS; do
  $PY scripts/lab/bench_emulated.py --kernel torch_flash --backends cad --eps-sweep none:0 --reps "$REPS" \
    --cad-runs "cad profiled eps0.01" --mixes sft,prolong --tokens sft:512k,prolong:128k --worlds 64 --budget-s 170 \
    --seed "$s" --dump-calls "$work/s$s" --out "$OUT/cad_calls_seed$s.md" | grep -E "\| cad "
  for mix in sft prolong; do
    $PY scripts/lab/profile_cad.py --load "$work/s$s/profile.json" --calls "$work/s$s/${mix}_w64_cad_profiled_eps0_01.json" \
      --replay --key-split --kernel torch_flash > "$OUT/cad_calls_replay_${mix}_seed$s.log" 2>&1
    tail -4 "$OUT/cad_calls_replay_${mix}_seed$s.log"
  done
done
tar czf "$OUT/cad_calls_dumps.tgz" -C "$work" .
