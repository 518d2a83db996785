#!/usr/bin/env bash
# CAD's per-server balance in kernel time at W = 8, 16 and 64, emulated on one GPU, in one call (about 8 minutes on
# an H200): CAD on the kernel's launch cost model at eps 0.01, which the first run fits (a cached model fitted on
# another grid, call set or merge is fitted again), on
# 1. W = 8 and 16: ProLong, Pretrain and SFT at 256K tokens (SEEDS_W16);
# 2. W = 64: SFT and Pretrain at 512K tokens and ProLong at 128K (SEEDS), every seed's kernel calls dumped;
# then the fitted model (with every call its fit timed) and the dumps copied to $OUT.
#
#   SEEDS="0 1 2" SEEDS_W16=0 REPS=2 OUT=bench/logs scripts/bench_cad_scale.sh
#
# Writes $OUT/cad_scale_w8_w16_seed$S.md, $OUT/cad_scale_w64_seed$S.md, $OUT/cad_scale_launch_model.json and
# $OUT/cad_scale_w64_dumps.tgz.
set -uo pipefail
source "$(dirname "$0")/bench_env.sh"
SEEDS=${SEEDS:-0 1 2}
SEEDS_W16=${SEEDS_W16:-0}
work=$(mktemp -d)
for s in $SEEDS_W16; do
  cad_emulated "$OUT/cad_scale_w8_w16_seed$s.md" --mixes sft,prolong,pretrain \
    --tokens prolong:256k,pretrain:256k,sft:256k --worlds 8,16 --budget-s 300 --seed "$s"
done
for s in $SEEDS; do cad_w64 "$s" "$OUT/cad_scale_w64_seed$s.md" "$work/s$s"; done
cp "$HF_LONGCTX_CACHE"/cad_cost/*-launch.json "$OUT/cad_scale_launch_model.json"
tar czf "$OUT/cad_scale_w64_dumps.tgz" -C "$work" .
