#!/usr/bin/env bash
# What cutting a forward call's keys into chunks buys CAD's servers (hf_longctx.kernels.key_split), on one GPU:
# 1. the launch model fitted again with the split forward, by the backend (into the cache it reads; copied to $OUT);
# 2. every forward call of two dumped W = 64 ProLong 256K steps timed again alone, whole and as the server now runs
#    it, each priced with the refitted model.
#
#   OUT=bench/logs scripts/lab/bench_key_split.sh
#
# Writes $OUT/key_split_fit.log, $OUT/launch_model_key_split.json and $OUT/key_split_replay_k{0,1}.log. About 2.5
# minutes on an H200.
set -uo pipefail
source "$(dirname "$0")/../bench_env.sh"
DUMPS=${DUMPS:-bench/logs/cad_prolong256k_w64_keys_limit_dumps_1xH200_2026-11-25.tgz}
work=$(mktemp -d)
tar xzf "$DUMPS" -C "$work"
# the backend's own fit (what the emulated steps then schedule on), copied beside the logs
fit_launch_model "$OUT/launch_model_key_split.json" > "$OUT/key_split_fit.log" 2>&1
for d in k0 k1; do
  $PY scripts/lab/profile_cad.py --load "$OUT/launch_model_key_split.json" \
    --calls "$work/$d/prolong_w64_cad_profiled_eps0_01.json" --replay --key-split --kernel torch_flash \
    > "$OUT/key_split_replay_$d.log" 2>&1
  tail -3 "$OUT/key_split_replay_$d.log"
done
