#!/usr/bin/env bash
# The same packed workloads run emulated on one GPU and for real on every GPU of the machine, in one call (about 5
# minutes on 4 H200s): per backend and mix, the emulation's per-rank kernel max/mean and predicted step time beside
# the real run's per-rank kernel max/mean (each call timed as the emulation times it) and measured step time.
#
#   OUT=bench/logs scripts/lab/bench_real_vs_emulated.sh                  # W = the machine's GPU count
#   W=8 TOKENS=524288 OUT=bench/logs scripts/lab/bench_real_vs_emulated.sh
#
# The emulation runs first and fits CAD's launch cost model once (cached in $HF_LONGCTX_CACHE), which the real run's
# ranks then read. The real run also checks every backend's outputs and gradients against one GPU.
# Writes $OUT/emulated_w$W.md and $OUT/real_w$W.md; with TRACE=1 also every rank's host ms per phase (in the real
# log) and op profiles with device timelines ($OUT/trace_w$W.tgz, see bench_attention.py --trace).
set -uo pipefail
source "$(dirname "$0")/../bench_env.sh"
W=${W:-$($PY -c "import torch; print(torch.cuda.device_count())")}
TOKENS=${TOKENS:-262144}
MIXES=${MIXES:-prolong,pretrain,sft}
BACKENDS=${BACKENDS:-ring,zigzag,distfa,tasp,cad,cad-profiled,ulysses}
if [ "$W" -lt 2 ]; then echo "bench_real_vs_emulated.sh needs at least 2 GPUs for the real run (found $W)"; exit 2; fi
common=(--seqs "" --packed-seqs "$TOKENS" --kv-heads 8 --backends "$BACKENDS" --mix "$MIXES")
nvidia-smi topo -m > "$OUT/real_w${W}_topology.txt" 2>&1
$PY scripts/bench_attention.py --emulate "$W" "${common[@]}" --reps 3 > "$OUT/emulated_w$W.md" 2>&1
trace=()
if [ -n "${TRACE:-}" ]; then trace=(--trace "$OUT/trace_w$W"); fi
$PY scripts/bench_attention.py --gpus "$W" "${common[@]}" --reps 5 --kernel-times --check-max "$TOKENS" \
  ${trace[@]+"${trace[@]}"} > "$OUT/real_w$W.md" 2>&1
if [ -n "${TRACE:-}" ]; then tar czf "$OUT/trace_w$W.tgz" -C "$OUT" "trace_w$W" && rm -r "$OUT/trace_w$W"; fi
for run in emulated real; do sed -n '/^| workload/,$p' "$OUT/${run}_w$W.md" | grep -E "^\|"; done  # the final tables
echo "checks against one GPU: $(grep "relative error.*OK$" "$OUT/real_w$W.md" | sort -u | wc -l) OK"
grep -E "FAILED|Error" "$OUT/real_w$W.md" | head -5
