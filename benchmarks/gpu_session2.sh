#!/usr/bin/env bash
# The next GPU session's call (one 600 s call of the `device` tool), after benchmarks/gpu_session.sh (2026-11-26):
#   1. the FLUX.1 bf16 demo that turned NaN at step 2 on an H100, now with cuDNN attention off (trainer/runtime.py)
#      and the non-finite-gradient stop: it must train 4 steps;
#   2. full-size FLUX.1 [dev] and SD3.5 Large LoRA points (`sdplan bench`, the planner's settings, batches up to 16):
#      the largest out-of-sample misses are FLUX.1 LoRA memory (reports of out-of-memory on 40-80 GB cards that the
#      planner puts at ~37 GiB), and no SD3.5 / FLUX.1 point has been measured by sdplan;
#   3. planner vs bench on what was measured.
# Before the call, here (the GPU image has no diffusers, no network; .whl/ is git-ignored):
#   .venv/bin/pip download --no-deps -d .whl "diffusers==$(.venv/bin/python -c 'import diffusers; print(diffusers.__version__)')" "importlib_metadata<8.8"
# The call:   run(command="bash benchmarks/gpu_session2.sh", carry=[".whl"], timeout_s=590)
# Results: $OUT/all.tgz (the device tool brings back 8 files at most) and the logs beside it. Ship the points with
#   sdplan profiles export --store <unpacked>/store FILE   (then append them to profiles/methods/, as on 2026-11-26)
# A CPU dry run on the tiny models:   GPU_SESSION_DEMO=1 OUT=/tmp/gpu2 bash benchmarks/gpu_session2.sh
source "$(dirname "$0")/gpu_setup.sh"  # OUT, PY, DEMO, log, pack; diffusers and sdplan installed
trap pack EXIT

# 1. the FLUX.1 bf16 demo (tiny model) on the GPU: 4 steps, a sample grid at step 2
log "flux bf16 demo"
device=cuda
[ -n "$DEMO" ] && device=cpu
SDPLAN_PROFILE_DIR="$OUT/trainstore" timeout 90 $SDPLAN train --demo --model flux --out "$OUT/flux-demo" \
    --max-steps 4 "training.device=$device" training.precision=bf16 sampling.every_steps=2 >"$OUT/flux-demo.txt" 2>&1
echo "exit $?" >>"$OUT/flux-demo.txt"
rm -rf "$OUT/flux-demo/base_model" "$OUT/flux-demo/dataset" "$OUT/flux-demo/checkpoints"

# 2. full-size transformer families: LoRA at the planner's settings (FLUX.1 [dev] first: the bigger question)
STORE="$OUT/store"
for model in flux-dev sd35-large; do
    log "bench $model"
    if [ -n "$DEMO" ]; then
        timeout 300 $SDPLAN bench --demo --model "$model" --method lora --store "$STORE" >>"$OUT/bench.txt" 2>&1
    else
        timeout "${BENCH_S:-200}" $SDPLAN bench --model "$model" --method lora --quick --store "$STORE" \
            >>"$OUT/bench.txt" 2>&1
    fi
    echo "exit $?" >>"$OUT/bench.txt"
done

# 3. predicted (shipped profiles) vs measured
log "planner vs bench"
$PY benchmarks/bench_vs_planner.py --store "$STORE" >"$OUT/bench_vs_planner.txt" 2>&1
$PY benchmarks/bench_vs_planner.py --store "$STORE" --json >"$OUT/bench_vs_planner.json" 2>/dev/null
log "done"
