# Sourced by the bench_*.sh scripts: run from the repository root with the package importable, write logs to
# $OUT (default bench/logs), keep fitted cost models in $HF_LONGCTX_CACHE (default outputs/cache) so that the
# parts of one call fit them once, and run Python as $PY (default python3).
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-bench/logs}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-}:$PWD
export HF_LONGCTX_CACHE=${HF_LONGCTX_CACHE:-$PWD/outputs/cache}
PY=${PY:-python3}
