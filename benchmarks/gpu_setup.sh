# Sourced by benchmarks/gpu_session*.sh: the results folder, logging, and the software the GPU image lacks.
# The image has no diffusers and no network: carry the wheels in .whl/ (see each session script's header).
set -uo pipefail
: "${OUT:?set OUT to the folder results go to}"
mkdir -p "$OUT"
# the Python that runs everything: $PY, else the clone's .venv (`make demo` / `make test` made it), else python
_venv_py="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.venv/bin/python"
if [ -z "${PY:-}" ] && [ -x "$_venv_py" ]; then PY=$_venv_py; fi
PY=${PY:-python}
DEMO=${GPU_SESSION_DEMO:-}
log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$OUT/session.log"; }
# the device tool returns 8 files: everything travels in one archive (tar's 1, a log still growing, is no failure)
pack() { tar czf "$OUT/all.tgz" -C "$OUT" --exclude all.tgz . 2>/dev/null || [ $? -eq 1 ]; }

if ! $PY -c "import diffusers" 2>/dev/null; then
    $PY -m pip install -q --no-index --find-links .whl diffusers 2>&1 | tail -3
fi
if ! $PY -c "import diffusers" 2>/dev/null; then  # a dependency the image lacks: the wheels alone, no resolver
    $PY -m pip install -q --no-deps .whl/*.whl 2>&1 | tail -3
fi
$PY -c "import diffusers" || { echo "diffusers does not import: stopping" >&2; exit 1; }
# always (`import sdplan` alone succeeds from the repo root without an install; sdplan.trainer and
# sdplan.profile_data exist only through the install's mapping)
$PY -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -5
$PY -c "import sdplan.trainer" || { echo "sdplan is not installed: stopping" >&2; exit 1; }
SDPLAN="$PY -m sdplan.cli"
{ nvidia-smi || true; $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } >"$OUT/versions.txt" 2>&1
STORE="$OUT/store"
# bench MODEL [key=value ...]: `sdplan bench` of a LoRA on the GPU (--quick, BENCH_S seconds at most; each
# point is saved when measured) or on the tiny demo model on the CPU, appended to bench.txt, then packed (what a
# call cut off at its limit has measured still comes back)
bench() {
    log "bench $*"
    local model=$1
    shift
    if [ -n "$DEMO" ]; then
        timeout 120 $SDPLAN bench --demo --model "$model" --method lora --store "$STORE" "$@" >>"$OUT/bench.txt" 2>&1
    else
        timeout "${BENCH_S:-120}" $SDPLAN bench --model "$model" --method lora --quick --store "$STORE" "$@" \
            >>"$OUT/bench.txt" 2>&1
    fi
    echo "exit $?" >>"$OUT/bench.txt"
    pack
}
# deepspeed_setup: DeepSpeed from .whl/ where the image lacks it, and what it will build CPU Adam with
deepspeed_setup() {
    if ! $PY -c "import deepspeed" 2>/dev/null; then
        $PY -m pip install -q --no-index --find-links .whl deepspeed 2>&1 | tail -3
    fi
    { $PY -c "import deepspeed; print('deepspeed', deepspeed.__version__)"; which g++ c++ nvcc ninja; echo "CUDA_HOME=${CUDA_HOME:-}"; } \
        >>"$OUT/versions.txt" 2>&1
}
# ds NAME ARGS...: one configuration of benchmarks/deepspeed_memory.py (one process; RUN_S seconds at most),
# appended to deepspeed.json, its stderr's tail kept, then packed
ds() {
    local name=$1
    shift
    log "deepspeed $name: $*"
    timeout "${RUN_S:-120}" $PY benchmarks/deepspeed_memory.py ${DEMO:+--demo} "$@" >>"$OUT/deepspeed.json" \
        2>>"$OUT/deepspeed-$name.err"
    echo "exit $? ($name)" >>"$OUT/deepspeed-$name.err"
    tail -c 3000 "$OUT/deepspeed-$name.err" >"$OUT/deepspeed-$name.tail" && rm -f "$OUT/deepspeed-$name.err"
    pack
}
