#!/usr/bin/env bash
# The next GPU call, after gpu_session4.sh (2026-11-26, 18:30 UTC; results in benchmarks/results/h100-2026-11-26.md):
#   1. FLUX.1 [dev] LoRA at 1024 px over an nf4 base with the fixed trainer (its Linear4bit now follows autocast):
#      the run before the fix allocated 4.4 GiB per image of batch (bf16: 2.3) at 1.26-1.39x bf16's step time;
#      the planner predicts 9.24 GiB at batch 1 and 2.4 GiB per image. Quantizing the random 12B base takes
#      minutes on the host: give it 300 s;
#   2. the trainer's step against the bare loop (1.21x SD1.5, 1.14x SDXL on 2026-11-26) under torch.profiler
#      (--profile): where the extra time goes (a host sync per step, accelerate's wrappers, clipping).
# Before the call, here (.whl/ is git-ignored; the GPU image has no diffusers, no bitsandbytes, no network):
#   .venv/bin/pip download --no-deps -d .whl "diffusers==$(.venv/bin/python -c 'import diffusers; print(diffusers.__version__)')" "importlib_metadata<8.8"
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_24_x86_64 -d .whl bitsandbytes==0.50.2
# The call:   run(command="bash benchmarks/gpu_session5.sh", carry=[".whl"], timeout_s=540)
# A CPU dry run on the tiny models:   GPU_SESSION_DEMO=1 OUT=/tmp/gpu5 bash benchmarks/gpu_session5.sh
source "$(dirname "$0")/gpu_setup.sh"  # OUT, PY, DEMO, log, pack; diffusers and sdplan installed
trap pack EXIT
if ! $PY -c "import bitsandbytes" 2>/dev/null && ls .whl/bitsandbytes-*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-deps .whl/bitsandbytes-*.whl 2>&1 | tail -2
fi
BENCH_S=${BENCH_S:-300} bench flux-dev model.base_precision=nf4
demo=${DEMO:+--demo}
for model in sd15 sdxl; do
    log "trainer vs reference $model"
    timeout "${REF_S:-90}" $PY benchmarks/trainer_vs_reference.py --model "$model" --batch 4 $demo --json \
        --profile "$OUT/profile-$model" >"$OUT/reference-$model.json" 2>"$OUT/reference-$model.err"
    echo "exit $?" >>"$OUT/reference-$model.err"
    pack
done
log "planner vs bench"
$PY benchmarks/bench_vs_planner.py --store "$STORE" >"$OUT/bench_vs_planner.txt" 2>&1
log "done"
