#!/usr/bin/env bash
# CAD scheduled on its launch cost model, then again on what its kernels measured (hf_longctx.lab.cad.calibrate:
# every task priced at its server's measured over predicted time), ROUNDS times, emulated on one GPU, in one call:
# each mix at each W, one batch per seed, every run's kernel calls dumped.
#
#   OUT=bench/logs SEEDS="1 2" WORLDS=32,64 MODEL=bench/logs/launch_model_....json scripts/lab/bench_cad_calibrated.sh
#
# MODEL (optional) is put in the cache first (use_launch_model), else the kernel's model is fitted on first use
# (minutes). Rows take 15-20 s each at W = 64 on an H200 (FA4), so 2 rounds over three mixes at W = 32 and 64 are
# about 5 minutes a seed; BUDGET (seconds per seed, default 240) stops starting new rows. Writes
# $OUT/cad_calibrated_seed<S>.md (and .log, its rows as they come) and $OUT/cad_calibrated_calls.tgz.
set -uo pipefail
source "$(dirname "$0")/../bench_env.sh"
KERNEL=${KERNEL:-fa4}
SEEDS=${SEEDS:-1}
WORLDS=${WORLDS:-32,64}
ROUNDS=${ROUNDS:-2}
REPS=${REPS:-4}
BUDGET=${BUDGET:-240}
MIXES=${MIXES:-prolong,pretrain,sft}
if [ -n "${MODEL:-}" ]; then
  use_launch_model "$MODEL" "$KERNEL" || exit 1
  # the cache keeps it only where its grid, terms and timing are this code's: else stop, rather than fit one now
  $PY -c "from hf_longctx.lab.cad.profiled import measured_cost_model as p; s = p('$KERNEL', \
profile_if_missing=False)[1]; print('cost model:', s); raise SystemExit(s.startswith('FLOPs'))" \
    || { echo "the cache did not take $MODEL: its grid, terms or timing are not this code's" >&2; exit 1; }
fi
CALLS=$(mktemp -d)
for seed in $SEEDS; do
  $PY scripts/lab/bench_emulated.py --kernel "$KERNEL" --backends cad --eps-sweep none:0 --reps "$REPS" \
    --cad-runs "cad profiled eps0.01" --calibrate "$ROUNDS" --mixes "$MIXES" \
    --tokens pretrain:512k,prolong:128k,sft:512k --worlds "$WORLDS" --seed "$seed" --budget-s "$BUDGET" \
    --dump-calls "$CALLS/seed$seed" --out "$OUT/cad_calibrated_seed$seed.md" | tee "$OUT/cad_calibrated_seed$seed.log" \
    | grep --line-buffered -E "^cost model|\| cad "
done
tar czf "$OUT/cad_calibrated_calls.tgz" -C "$CALLS" . && rm -rf "$CALLS"
