#!/usr/bin/env bash
# Whether the launch profile should time its calls with the L2 cache evicted, in one call (about 8 minutes on an
# H200):
# 1. every GPU test;
# 2. the dumped calls of earlier W = 64 steps (DUMPS, seed 0's SFT and ProLong) timed again alone, with the L2 warm
#    (each call timed again over its own buffers, as the profile has timed them) and evicted before every run,
#    beside their time in the step and the earlier model's price (MODEL);
# 3. CAD at W = 64 (SFT and Pretrain at 512K tokens, ProLong at 128K; SEEDS) on a launch model fitted with the L2
#    evicted (HF_LONGCTX_PROFILE_L2=evicted), every seed's calls dumped;
# 4. that model (with every call its fit timed) and the dumps copied to $OUT.
#
#   SEEDS="0 1" OUT=bench/logs scripts/lab/bench_cad_l2.sh
#
# Writes $OUT/l2_gpu_tests.log, $OUT/l2_replay_{sft,prolong}_{warm,evicted}.log, $OUT/cad_l2_w64_seed$S.md,
# $OUT/launch_model_l2_evicted.json and $OUT/cad_l2_w64_dumps.tgz.
set -uo pipefail
source "$(dirname "$0")/../bench_env.sh"
SEEDS=${SEEDS:-0 1}
DUMPS=${DUMPS:-bench/logs/cad_merge_min_shared16k_w64_dumps_1xH200_2026-11-28.tgz}
MODEL=${MODEL:-bench/logs/launch_model_merge_min_shared16k_1xH200_2026-11-28.json}
work=$(mktemp -d)
$PY -m pytest -m gpu -q tests/gpu > "$OUT/l2_gpu_tests.log" 2>&1
tail -1 "$OUT/l2_gpu_tests.log"
mkdir -p "$work/earlier" && tar xzf "$DUMPS" -C "$work/earlier"
for mix in sft prolong; do
  for l2 in warm evicted; do
    flag=(); [ "$l2" = evicted ] && flag=(--cold)
    $PY scripts/lab/profile_cad.py --load "$MODEL" --calls "$work/earlier/s0/${mix}_w64_cad_profiled_eps0_01.json" \
      --replay --kernel torch_flash "${flag[@]}" > "$OUT/l2_replay_${mix}_${l2}.log" 2>&1
    grep -E "calls, |replayed" "$OUT/l2_replay_${mix}_${l2}.log"
  done
done
export HF_LONGCTX_PROFILE_L2=evicted
for s in $SEEDS; do cad_w64 "$s" "$OUT/cad_l2_w64_seed$s.md" "$work/s$s"; done
cp "$HF_LONGCTX_CACHE"/cad_cost/*-launch.json "$OUT/launch_model_l2_evicted.json"
tar czf "$OUT/cad_l2_w64_dumps.tgz" -C "$work" --exclude earlier .
