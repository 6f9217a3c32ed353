#!/usr/bin/env bash
# Issue 12's measurements in one call of the lent GPU machine (the `device` tool), results under $OUT.
#
# Before the call, here (the GPU image has no diffusers and no network; .whl/ is git-ignored):
#   .venv/bin/pip download --no-deps -d .whl "diffusers==$(.venv/bin/python -c 'import diffusers; print(diffusers.__version__)')"
# The call:   run(command="bash benchmarks/gpu_session.sh", carry=[".whl"], timeout_s=600)
# A CPU dry run of the same script on the tiny demo models:   GPU_SESSION_DEMO=1 OUT=/tmp/gpu-out bash benchmarks/gpu_session.sh
#
# Each stage has its own time budget and writes as it goes (`sdplan bench` saves every point when measured), so
# a stage that runs out of time still leaves its points; the next stage runs regardless.
set -uo pipefail
: "${OUT:?set OUT to the folder results go to}"
mkdir -p "$OUT"
PY=${PY:-python}
DEMO=${GPU_SESSION_DEMO:-}
log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$OUT/session.log"; }

# 1. the software the image lacks, and sdplan from this working tree
if ! $PY -c "import diffusers" 2>/dev/null; then
    $PY -m pip install -q --no-index --find-links .whl diffusers 2>&1 | tail -3
fi
$PY -c "import sdplan" 2>/dev/null || $PY -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
SDPLAN="$PY -m sdplan.cli"
{ nvidia-smi || true; $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } >"$OUT/versions.txt" 2>&1

# 2. the real doctor snapshot (a test fixture once committed: tests/fixtures/machines/)
log "doctor"
$SDPLAN doctor --json >"$OUT/doctor.json" 2>"$OUT/doctor.err"
$SDPLAN doctor >"$OUT/doctor.txt" 2>&1

# 3. bench: the largest batch that fits, it/s and peak memory per point, sd15 and sdxl x three methods
STORE="$OUT/store"
if [ -n "$DEMO" ]; then
    log "bench (demo, CPU)"
    timeout 300 $SDPLAN bench --demo --store "$STORE" >"$OUT/bench.txt" 2>&1
else
    for model in sd15 sdxl; do
        log "bench $model"
        timeout "${BENCH_S:-200}" $SDPLAN bench --model "$model" --method lora --method dreambooth \
            --method finetune --quick --store "$STORE" >>"$OUT/bench.txt" 2>&1
        echo "exit $?" >>"$OUT/bench.txt"
    done
fi

# 4. predicted (before: shipped profiles only; leave-one-out) vs measured
log "planner vs bench"
$PY benchmarks/bench_vs_planner.py --store "$STORE" >"$OUT/bench_vs_planner.txt" 2>&1
$PY benchmarks/bench_vs_planner.py --store "$STORE" --json >"$OUT/bench_vs_planner.json" 2>/dev/null
log "done"
