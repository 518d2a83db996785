#!/usr/bin/env bash
# CAD's per-server balance in kernel time, emulated on one GPU, in one call (about 5 minutes on an H100 or H200):
# W = 4, 8, 16 on the ProLong and Pretrain mixes (256K tokens) and the short-document SFT mix (128K), then W = 64
# on Pretrain and SFT at 512K and ProLong at 128K, each CAD three ways: FLOPs at eps 0.1 (the default), the launch cost model at eps
# 0.01 and the interpolated grid profile at eps 0.01. Both measured models are fitted once (kept in
# $HF_LONGCTX_CACHE) and used by both parts; every profiled run's kernel calls are dumped for checking the model.
#
#   OUT=bench/logs SEED=0 scripts/lab/bench_cad_balance.sh
#
# SEED picks the batch of each mix; PART=w4_w16 or PART=w64 runs one part (each fits a 10-minute call). Writes $OUT/cad_balance_w4_w16.md, $OUT/cad_balance_w64.md and
# $OUT/cad_balance_calls.tgz (about 7 minutes with ProLong at W = 64).
set -uo pipefail
source "$(dirname "$0")/../bench_env.sh"
REPS=${REPS:-3}
SEED=${SEED:-0}
PART=${PART:-all}
RUNS="cad flops eps0.1,cad profiled eps0.01,cad grid-profiled eps0.01"
CALLS=$(mktemp -d)
common=(--kernel torch_flash --backends cad --eps-sweep none:0 --also-grid --cad-runs "$RUNS" --reps "$REPS" --seed "$SEED")
if [ "$PART" != w64 ]; then
  $PY scripts/lab/bench_emulated.py "${common[@]}" --mixes pretrain,prolong,sft --worlds 4,8,16 --budget-s 420 \
    --dump-calls "$CALLS/w4_w16" --out "$OUT/cad_balance_w4_w16.md" | grep -E "profiled eps0.01 \||cost model"
fi
if [ "$PART" != w4_w16 ]; then
  $PY scripts/lab/bench_emulated.py "${common[@]}" --mixes pretrain,sft,prolong \
    --tokens pretrain:512k,sft:512k,prolong:128k --worlds 64 --budget-s 300 --dump-calls "$CALLS/w64" \
    --out "$OUT/cad_balance_w64.md" | grep -E "profiled eps0.01 \|"
fi
tar czf "$OUT/cad_balance_calls.tgz" -C "$CALLS" . && rm -rf "$CALLS"
