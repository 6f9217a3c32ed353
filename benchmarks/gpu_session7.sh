#!/usr/bin/env bash
# The next GPU call (about 4 minutes), after gpu_session5/6.sh (2026-11-27; benchmarks/results/h100-2026-11-27.md):
#   1. SD3.5 Medium LoRA at 1024 px WITHOUT gradient checkpointing: sdplan bench measured it with checkpointing
#      only (2026-11-26), and SimpleTuner's sweep (benchmarks/validation/, simpletuner-segckpt-sd35m-*-nogc)
#      reports 13-20% more than the planner predicts without it. Those are validation points: the activation
#      factor without checkpointing must come from a measurement of our own;
#   2. the trainer's SDXL step against the bare loop, timed without the profiler (the profiled run passed its
#      80 s limit on 2026-11-27; SD1.5 came out 0.94x, where 2026-11-26's unprofiled 3 steps said 1.21x).
# The call:   run(command="bash benchmarks/gpu_session7.sh", carry=[".whl"], timeout_s=300)
# A CPU dry run on the tiny models:   GPU_SESSION_DEMO=1 OUT=/tmp/gpu7 PY=.venv/bin/python bash benchmarks/gpu_session7.sh
source "$(dirname "$0")/gpu_setup.sh"  # OUT, PY, DEMO, log, pack; diffusers and sdplan installed
trap pack EXIT
BENCH_S=${BENCH_S:-150} bench sd35-medium memory.gradient_checkpointing=false
demo=${DEMO:+--demo}
log "trainer vs reference sdxl"
timeout "${REF_S:-70}" $PY benchmarks/trainer_vs_reference.py --model sdxl --batch 4 $demo --json \
    >"$OUT/reference-sdxl.json" 2>"$OUT/reference-sdxl.err"
echo "exit $?" >>"$OUT/reference-sdxl.err"
pack
log "planner vs bench"
$PY benchmarks/bench_vs_planner.py --store "$STORE" >"$OUT/bench_vs_planner.txt" 2>&1
log "done"
