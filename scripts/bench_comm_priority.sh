#!/usr/bin/env bash
# The sequence-parallel backends with their transfers on NCCL streams of normal and of high priority, on every GPU
# of the machine, in one call (about 5 minutes on 4 H200s): each backend runs on a group of normal-priority streams
# and on one of high-priority streams in the same process, then again in the other order.
#
#   OUT=bench/logs scripts/bench_comm_priority.sh          # W = the machine's GPU count
#
# Writes $OUT/comm_priority_w$W.md (normal first) and $OUT/comm_priority_reversed_w$W.md (high first), and prints
# both tables' step times side by side.
set -uo pipefail
source "$(dirname "$0")/bench_env.sh"
W=${W:-$($PY -c "import torch; print(torch.cuda.device_count())")}
TOKENS=${TOKENS:-262144}
BACKENDS=${BACKENDS:-ring,zigzag,distfa,tasp,cad,ulysses}
if [ "$W" -lt 2 ]; then echo "bench_comm_priority.sh needs at least 2 GPUs (found $W)"; exit 2; fi
common=(--gpus "$W" --seqs "" --packed-seqs "$TOKENS" --kv-heads 8 --backends "$BACKENDS" --mix prolong,pretrain,sft
        --single-max 0 --reps "${REPS:-5}")
$PY scripts/bench_attention.py "${common[@]}" --comm-priority normal,high > "$OUT/comm_priority_w$W.md" 2>&1
$PY scripts/bench_attention.py "${common[@]}" --comm-priority high,normal > "$OUT/comm_priority_reversed_w$W.md" 2>&1
$PY - "$OUT/comm_priority_w$W.md" "$OUT/comm_priority_reversed_w$W.md" <<'PYEOF'
import sys
runs = []
for path in sys.argv[1:]:
    ms = {}
    for line in open(path):
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) >= 9 and "@" in cells[3]:
            ms[(cells[0], cells[3])] = float(cells[8])
    runs.append(ms)
print("| mix | backend | normal ms (first) | high ms (second) | high/normal | normal ms (second) | high ms (first) "
      "| high/normal |")
print("|---|---|---|---|---|---|---|---|")
for mix, label in sorted({(m, b.split("@")[0]) for m, b in runs[0]}):
    a = [runs[i].get((mix, f"{label}@{p}"), float("nan")) for i in (0, 1) for p in ("normal", "high")]
    print(f"| {mix} | {label} | {a[0]:.1f} | {a[1]:.1f} | {a[1] / a[0]:.3f} | {a[2]:.1f} | {a[3]:.1f} | "
          f"{a[3] / a[2]:.3f} |")
PYEOF
grep -E "Error|FAILED" "$OUT"/comm_priority*_w$W.md | head -5 || true
