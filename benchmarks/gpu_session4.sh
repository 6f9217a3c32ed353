#!/usr/bin/env bash
# RAN on 2026-11-26 at 18:30 UTC (results: benchmarks/results/h100-2026-11-26.md, "Third session"); the next call is
# gpu_session5.sh.
# The next GPU session's call (one 600 s call of the `device` tool), after gpu_session3.sh (2026-11-26):
#   1. the trainer's step against diffusers' LoRA example loop written out bare (benchmarks/trainer_vs_reference.py,
#      SD1.5 and SDXL, batch 4): the ratio issue 12 left open;
#   2. FLUX.1 [dev] LoRA at 1024 px over an fp8 and an nf4 frozen base (`sdplan bench model.base_precision=...`): the
#      planner's quantized-base memory is modelled, its time factor (x1.1 fp8, x1.3 nf4) is a guess, and the
#      validation set's two largest FLUX.1 speed misses are nf4 runs. fp8 without checkpointing: beside the bf16
#      points without it (50.0 GiB at batch 1), it shows the trainer's Fp8Linear keeps no upcast copies for the
#      backward (expect about 11 GiB less, not 11 GiB more as through diffusers' layerwise-casting hook);
#   3. SD3.5 Medium LoRA at 1024 px (no point yet);
#   4. planner vs bench.
# Before the call, here (the GPU image has no diffusers, no network; .whl/ is git-ignored):
#   .venv/bin/pip download --no-deps -d .whl "diffusers==$(.venv/bin/python -c 'import diffusers; print(diffusers.__version__)')" "importlib_metadata<8.8"
#   (nf4 needs bitsandbytes: add it to .whl/ too if the image lacks it: `pip download --no-deps -d .whl bitsandbytes`)
# The call:   run(command="bash benchmarks/gpu_session4.sh", carry=[".whl"], timeout_s=590)
# Results: $OUT/all.tgz; ship the points with `sdplan profiles export --store <unpacked>/store FILE` (as on 2026-11-26).
# A CPU dry run on the tiny models:   GPU_SESSION_DEMO=1 OUT=/tmp/gpu4 bash benchmarks/gpu_session4.sh
source "$(dirname "$0")/gpu_setup.sh"  # OUT, PY, DEMO, log, pack; diffusers and sdplan installed
trap pack EXIT
if ! $PY -c "import bitsandbytes" 2>/dev/null && ls .whl/bitsandbytes-*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-deps .whl/bitsandbytes-*.whl 2>&1 | tail -2
fi
demo=${DEMO:+--demo}

# 2-3. quantized FLUX.1 bases, SD3.5 Medium
BENCH_S=${BENCH_S:-110}  # gpu_setup.sh's bench(): each model's limit
bench flux-dev model.base_precision=fp8 memory.gradient_checkpointing=false
bench flux-dev model.base_precision=nf4
bench sd35-medium

# 4. predicted (shipped profiles) vs measured
log "planner vs bench"
$PY benchmarks/bench_vs_planner.py --store "$STORE" >"$OUT/bench_vs_planner.txt" 2>&1
pack
# 5. the trainer vs a bare loop (last: issue 12 is closed; what time is left)
for model in sd15 sdxl; do
    log "trainer vs reference $model"
    timeout "${REF_S:-120}" $PY benchmarks/trainer_vs_reference.py --model "$model" --batch 4 $demo --json \
        >"$OUT/reference-$model.json" 2>"$OUT/reference-$model.err"
    echo "exit $?" >>"$OUT/reference-$model.err"
    pack
done

log "done"
