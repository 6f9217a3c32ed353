#!/usr/bin/env bash
# A short GPU call (about 4 minutes) after gpu_session7.sh, which timed the trainer's SDXL step at 1.13x the bare
# loop (batch 4, unprofiled; SD1.5 was 0.94x profiled): SDXL under torch.profiler, with a limit it fits in (the
# profiled run of 2026-11-27 passed 80 s), each loop's operators by GPU and by host time, to find the extra 13%.
# The call:   run(command="bash benchmarks/gpu_session8.sh", carry=[".whl"], timeout_s=420)
# A CPU dry run on the tiny models:   GPU_SESSION_DEMO=1 OUT=/tmp/gpu8 PY=.venv/bin/python bash benchmarks/gpu_session8.sh
source "$(dirname "$0")/gpu_setup.sh"  # OUT, PY, DEMO, log, pack; diffusers and sdplan installed
trap pack EXIT
demo=${DEMO:+--demo}
log "trainer vs reference sdxl, profiled"
timeout "${REF_S:-300}" $PY benchmarks/trainer_vs_reference.py --model sdxl --batch 4 $demo --json \
    --profile "$OUT/profile-sdxl" >"$OUT/reference-sdxl.json" 2>"$OUT/reference-sdxl.err"
echo "exit $?" >>"$OUT/reference-sdxl.err"
log "done"
