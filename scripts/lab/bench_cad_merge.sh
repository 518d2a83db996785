#!/usr/bin/env bash
# The key split's merge as one Triton kernel, which calls pay to cut, and CAD's balance after it, emulated on one
# GPU in one call (about 6-7 minutes on an H200):
# 1. the GPU tests of the merge and the key split (TESTS=all: every GPU test);
# 2. scripts/bench_merge.py: the merge alone and inside cut forwards, Triton against torch's index ops; and the
#    forward calls of earlier dumped W = 64 steps (DUMPS) that a lower min_shared would cut, timed whole and cut;
# 3. CAD at W = 64 on Pretrain and SFT at 512K tokens and ProLong at 128K (SEEDS), then at W = 8 and 16 on ProLong
#    and Pretrain at 256K (SEEDS_W16), eps 0.01 on the launch model, which the first run fits again (a model
#    cached with another merge or rule is not reused), every W = 64 seed's calls dumped;
# 4. that model (with every call its fit timed) and the dumps copied to $OUT.
#
#   SEEDS="0 1 2" SEEDS_W16=0 OUT=bench/logs scripts/lab/bench_cad_merge.sh
#
# Writes $OUT/merge_gpu_tests.log, $OUT/merge_bench.md, $OUT/cad_merge_w64_seed$S.md, $OUT/cad_merge_w16_seed$S.md,
# $OUT/launch_model_merge.json and $OUT/cad_merge_w64_dumps.tgz.
set -uo pipefail
source "$(dirname "$0")/../bench_env.sh"
SEEDS=${SEEDS:-0 1 2}
SEEDS_W16=${SEEDS_W16:-0}
DUMPS=${DUMPS:-bench/logs/cad_merge_w64_dumps_1xH200_2026-11-28.tgz}
work=$(mktemp -d)
if [ "${TESTS:-merge}" = all ]; then tests=(tests/gpu); else
  tests=(tests/gpu/test_merge_gpu.py tests/gpu/test_key_split_gpu.py); fi
$PY -m pytest -m gpu -q "${tests[@]}" > "$OUT/merge_gpu_tests.log" 2>&1
tail -1 "$OUT/merge_gpu_tests.log"
mkdir -p "$work/earlier" && tar xzf "$DUMPS" -C "$work/earlier"
$PY scripts/bench_merge.py --calls "$(find "$work/earlier" -name '*_w64_*.json' | sort | paste -sd,)" \
  > "$OUT/merge_bench.md" 2>&1
cat "$OUT/merge_bench.md"
for s in $SEEDS; do cad_w64 "$s" "$OUT/cad_merge_w64_seed$s.md" "$work/s$s"; done
for s in $SEEDS_W16; do
  cad_emulated "$OUT/cad_merge_w16_seed$s.md" --mixes prolong,pretrain --worlds 8,16 --budget-s 150 --seed "$s"
done
cp "$HF_LONGCTX_CACHE"/cad_cost/*-launch.json "$OUT/launch_model_merge.json"
tar czf "$OUT/cad_merge_w64_dumps.tgz" -C "$work" --exclude earlier .
