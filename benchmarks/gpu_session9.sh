#!/usr/bin/env bash
# A short GPU call (about 3 minutes) after gpu_session8.sh: the trainer's SDXL step ran 1.12-1.13x the bare loop's
# (batch 4), with the same GPU kernels (17098 / 17051) and GPU time (280 ms of a 540-600 ms step: host-bound),
# the extra host time spread evenly over every operator. The trainer's loop always ran first: the same timing
# with the bare loop first, then again in the first order, tells an order effect from an overhead of ours.
# The call:   run(command="bash benchmarks/gpu_session9.sh", carry=[".whl"], timeout_s=300)
# A CPU dry run on the tiny models:   GPU_SESSION_DEMO=1 OUT=/tmp/gpu9 PY=.venv/bin/python bash benchmarks/gpu_session9.sh
source "$(dirname "$0")/gpu_setup.sh"  # OUT, PY, DEMO, log, pack; diffusers and sdplan installed
trap pack EXIT
demo=${DEMO:+--demo}
for order in --reference-first "" --reference-first; do
    log "trainer vs reference sdxl $order"
    timeout "${REF_S:-80}" $PY benchmarks/trainer_vs_reference.py --model sdxl --batch 4 $demo --json $order \
        >>"$OUT/reference-sdxl.json" 2>>"$OUT/reference-sdxl.err"
    echo "exit $?" >>"$OUT/reference-sdxl.err"
    pack
done
log "done"
