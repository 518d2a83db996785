#!/usr/bin/env bash
# Whole steps of every backend, this tree against another version of the package, in one call. BEFORE=DIR holds
# that version's hf_longctx/ (`git archive REV hf_longctx | tar x -C DIR`); the two run alternately, ROUNDS times
# each (default 3), every run a fresh process, so that the device's drift over the call falls on both alike. Prints
# each backend's median ms per version and after / before, and writes them to $OUT/step_versions.md.
# - emulated on one GPU (default): bench_merge.py --steps STEPS (all ranks' forward+backward, wall ms);
# - REAL=W: real steps on W GPUs, bench_attention.py --gpus W on 256K-token packed batches of MIXES (fwd+bwd ms).
#
#   BEFORE=outputs/before STEPS=sft:256k:4,pretrain:256k:4 ROUNDS=3 OUT=bench/logs scripts/bench_step_versions.sh
#   BEFORE=outputs/before REAL=2 MIXES=sft,pretrain ROUNDS=2 OUT=bench/logs scripts/bench_step_versions.sh
set -euo pipefail
source "$(dirname "$0")/bench_env.sh"
: "${BEFORE:?BEFORE=DIR: a directory holding the other version of hf_longctx/}"
[ -d "$BEFORE/hf_longctx" ] || { echo "BEFORE=$BEFORE holds no hf_longctx/" >&2; exit 2; }
STEPS=${STEPS:-sft:256k:4,pretrain:256k:4}
REAL=${REAL:-0}
MIXES=${MIXES:-sft,pretrain}
BACKENDS=${BACKENDS:-ring,zigzag,distfa,tasp,cad}
ROUNDS=${ROUNDS:-3}
work=$(mktemp -d)
one_run() {  # one version's steps as JSON lines
  if [ "$REAL" -gt 1 ]; then
    $PY scripts/bench_attention.py --gpus "$REAL" --seqs "" --packed-seqs 262144 --kv-heads 8 --backends "$BACKENDS" \
      --mix "$MIXES" --reps 5 --single-max 0 | $PY -c '
import json, sys
rows = {}  # the table is printed more than once: one row per (mix, backend)
for line in sys.stdin:
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) > 8 and cells[0].endswith(" mix"):
        rows[cells[0][:-4], cells[3]] = float(cells[8])
for (mix, backend), ms in rows.items():
    print(json.dumps({"mix": mix, "tokens": 262144, "world": '"$REAL"', "backend": backend, "ms": ms}))'
  else
    $PY scripts/bench_merge.py --steps "$STEPS" --steps-only --as-is --step-backends "$BACKENDS"
  fi
}
for ((i = 0; i < ROUNDS; i++)); do
  for version in before after; do
    root=$PWD
    [ "$version" = before ] && root=$(cd "$BEFORE" && pwd)
    PYTHONPATH=$root one_run >> "$work/$version.jsonl"
  done
done
$PY - "$work" "$BEFORE" "$([ "$REAL" -gt 1 ] && echo real || echo "$STEPS")" "$ROUNDS" <<'PYEOF' | tee "$OUT/step_versions.md"
import json, statistics, sys
from pathlib import Path
work, before, steps, rounds = sys.argv[1:]
runs = {v: [json.loads(line) for line in (Path(work) / f"{v}.jsonl").read_text().splitlines()]
        for v in ("before", "after")}
keys = list(dict.fromkeys((r["mix"], r["tokens"], r["world"], r["backend"]) for r in runs["after"]))
real = runs["after"][0]["world"] if runs["after"] else 0
what = "Real steps (fwd+bwd ms of bench_attention.py" if steps == "real" else \
    "Emulated steps (all ranks' forward+backward on one GPU, wall ms"
print(f"{what}; median of {rounds} processes per version, alternating; before = {before}, after = this tree; "
      f"{'W = ' + str(real) if steps == 'real' else 'steps ' + steps})\n")
print("| mix | W | backend | before ms | after ms | after / before |\n|---|---|---|---|---|---|")
for key in keys:
    ms = {v: statistics.median(r["ms"] for r in runs[v] if (r["mix"], r["tokens"], r["world"], r["backend"]) == key)
          for v in runs}
    print(f"| {key[0]} {key[1] // 1024}K | {key[2]} | {key[3]} | {ms['before']:.1f} | {ms['after']:.1f} | "
          f"{ms['after'] / ms['before']:.3f} |")
PYEOF
