#!/usr/bin/env bash
# The key split's merge as one Triton kernel, and CAD's balance at W = 64 after it, emulated on one GPU in one call
# (about 6-7 minutes on an H200):
# 1. the GPU tests (tests/gpu, the merge's among them);
# 2. scripts/bench_merge.py: the merge alone and inside cut forwards, Triton against torch's index ops;
# 3. CAD at W = 64 on Pretrain and SFT at 512K tokens and ProLong at 128K, eps 0.01 on the launch model, which the
#    first run fits again (a model cached with another merge is not reused), each seed's calls dumped;
# 4. that model and the dumps copied to $OUT.
#
#   SEEDS="0 1 2" OUT=bench/logs scripts/bench_cad_merge.sh
#
# Writes $OUT/merge_gpu_tests.log, $OUT/merge_bench.md, $OUT/cad_merge_w64_seed$S.md, $OUT/launch_model_merge.json
# and $OUT/cad_merge_w64_dumps.tgz.
set -uo pipefail
source "$(dirname "$0")/bench_env.sh"
SEEDS=${SEEDS:-0 1 2}
REPS=${REPS:-2}
work=$(mktemp -d)
$PY -m pytest -m gpu -q tests/gpu > "$OUT/merge_gpu_tests.log" 2>&1
tail -2 "$OUT/merge_gpu_tests.log"
$PY scripts/bench_merge.py > "$OUT/merge_bench.md" 2>&1
cat "$OUT/merge_bench.md"
for s in $SEEDS; do
  $PY scripts/bench_emulated.py --kernel torch_flash --backends cad --eps-sweep none:0 --reps "$REPS" \
    --cad-runs "cad profiled eps0.01" --mixes pretrain,sft,prolong --tokens pretrain:512k,sft:512k,prolong:128k \
    --worlds 64 --budget-s 170 --seed "$s" --dump-calls "$work/s$s" --out "$OUT/cad_merge_w64_seed$s.md" \
    | grep -E "\| cad "
done
cp "$HF_LONGCTX_CACHE"/cad_cost/*-launch.json "$OUT/launch_model_merge.json"
tar czf "$OUT/cad_merge_w64_dumps.tgz" -C "$work" .
