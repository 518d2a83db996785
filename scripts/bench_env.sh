# Sourced by the bench_*.sh scripts: run from the repository root with the package importable, write logs to
# $OUT (default bench/logs), keep fitted cost models in $HF_LONGCTX_CACHE (default outputs/cache) so that the
# parts of one call fit them once, and run Python as $PY (default python3).
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-bench/logs}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-}:$PWD
export HF_LONGCTX_CACHE=${HF_LONGCTX_CACHE:-$PWD/outputs/cache}
PY=${PY:-python3}

# CAD on the kernel's launch cost model at eps 0.01 (fitted on first use), emulated: cad_emulated OUT_FILE ARGS...
# passes ARGS on to bench_emulated.py (--mixes, --worlds, --seed, ...) and prints CAD's rows; REPS timed steps each.
cad_emulated() {
  local out=$1; shift
  $PY scripts/lab/bench_emulated.py --kernel torch_flash --backends cad --eps-sweep none:0 --reps "${REPS:-2}" \
    --cad-runs "cad profiled eps0.01" --out "$out" "$@" | grep -E "\| cad "
}

# The W = 64 row set of the CAD scripts: cad_w64 SEED OUT_FILE DUMP_DIR (SFT and Pretrain at 512K tokens, ProLong at
# 128K; every kernel call dumped to DUMP_DIR).
cad_w64() {
  cad_emulated "$2" --mixes sft,prolong,pretrain --tokens pretrain:512k,sft:512k,prolong:128k --worlds 64 \
    --budget-s 170 --seed "$1" --dump-calls "$3"
}

# The backend's own launch cost model of torch_flash on this GPU (fitted now unless the cache holds one fitted on the
# same grid, call set and merge), copied to OUT_JSON, its source and meta printed: fit_launch_model OUT_JSON
fit_launch_model() {
  $PY - "$1" <<'PYEOF'
import json, logging, shutil, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout)
import torch
from hf_longctx.lab.cad.profiled import SegmentShape, launch_cache_path, measured_cost_model
print("model:", measured_cost_model("torch_flash")[1])
path = launch_cache_path(torch.device("cuda"), "torch_flash", SegmentShape())
print("meta:", json.dumps(json.loads(path.read_text())["meta"]))
shutil.copy(path, sys.argv[1])
PYEOF
}

# Put a saved launch cost model (a fit of an earlier call, e.g. bench/logs/launch_model_*.json) in the cache as this
# code's model of KERNEL on this GPU, so that a call spends no time fitting one: use_launch_model FILE KERNEL. Its
# meta keeps the call set it was fitted on (call_set_fitted); the cache then takes it as of today's call set.
use_launch_model() {
  $PY - "$1" "$2" <<'PYEOF'
import json, sys
import torch
from hf_longctx.lab.cad.call_profile import CALL_SET
from hf_longctx.lab.cad.profiled import SegmentShape, launch_cache_path
data = json.loads(open(sys.argv[1]).read())
meta = data.setdefault("meta", {})
meta.setdefault("call_set_fitted", meta.get("call_set"))
meta["call_set"] = CALL_SET
path = launch_cache_path(torch.device("cuda"), sys.argv[2], SegmentShape())
path.parent.mkdir(parents=True, exist_ok=True)
path.write_text(json.dumps(data))
print(f"launch model {sys.argv[1]} (fitted on call set {meta['call_set_fitted']}) -> {path}")
PYEOF
}
