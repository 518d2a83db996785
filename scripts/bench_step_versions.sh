#!/usr/bin/env bash
# Whole emulated steps of every backend (bench_merge.py --steps), this tree against another version of the package,
# in one call. BEFORE=DIR holds that version's hf_longctx/ (`git archive REV hf_longctx | tar x -C DIR`); the two
# run alternately, ROUNDS times each (default 3), every run a fresh process, so that the device's drift over the call
# falls on both alike. Prints each backend's median ms per version and after / before, and writes them to
# $OUT/step_versions.md.
#
#   BEFORE=outputs/before STEPS=sft:256k:4,pretrain:256k:4 ROUNDS=3 OUT=bench/logs scripts/bench_step_versions.sh
set -euo pipefail
source "$(dirname "$0")/bench_env.sh"
: "${BEFORE:?BEFORE=DIR: a directory holding the other version of hf_longctx/}"
[ -d "$BEFORE/hf_longctx" ] || { echo "BEFORE=$BEFORE holds no hf_longctx/" >&2; exit 2; }
STEPS=${STEPS:-sft:256k:4,pretrain:256k:4}
ROUNDS=${ROUNDS:-3}
work=$(mktemp -d)
for ((i = 0; i < ROUNDS; i++)); do
  for version in before after; do
    root=$PWD
    [ "$version" = before ] && root=$(cd "$BEFORE" && pwd)
    PYTHONPATH=$root $PY scripts/bench_merge.py --steps "$STEPS" --steps-only --as-is >> "$work/$version.jsonl"
  done
done
$PY - "$work" "$BEFORE" "$STEPS" "$ROUNDS" <<'PYEOF' | tee "$OUT/step_versions.md"
import json, statistics, sys
from pathlib import Path
work, before, steps, rounds = sys.argv[1:]
runs = {v: [json.loads(line) for line in (Path(work) / f"{v}.jsonl").read_text().splitlines()]
        for v in ("before", "after")}
keys = list(dict.fromkeys((r["mix"], r["tokens"], r["world"], r["backend"]) for r in runs["after"]))
print(f"Emulated steps (all ranks' forward+backward on one GPU, wall ms; median of {rounds} processes per version, "
      f"alternating; before = {before}, after = this tree; steps {steps})\n")
print("| mix | W | backend | before ms | after ms | after / before |\n|---|---|---|---|---|---|")
for key in keys:
    ms = {v: statistics.median(r["ms"] for r in runs[v] if (r["mix"], r["tokens"], r["world"], r["backend"]) == key)
          for v in runs}
    print(f"| {key[0]} {key[1] // 1024}K | {key[2]} | {key[3]} | {ms['before']:.1f} | {ms['after']:.1f} | "
          f"{ms['after'] / ms['before']:.3f} |")
PYEOF
