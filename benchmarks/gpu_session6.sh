#!/usr/bin/env bash
# A short GPU call (about 3 minutes): the UNets' launch-bound step WITH gradient checkpointing.
# Why: the planner's UNet floors were measured without checkpointing (gpu_session3/4, H100) and serve the
# checkpointed step too; SimpleTuner's sweep (benchmarks/validation/sd15.yaml, simpletuner-segckpt-*) measured a
# checkpointed SD 1.5 LoRA step on an H100 at 1.7x the unchecked one (launch-bound: the recomputation launches
# every kernel again), which the planner predicts 1.9x too fast. Those are validation points: the floor must come
# from a measurement of our own. `sdplan bench` at batch 1-8 with checkpointing on gives it (the points land in
# the store; `sdplan profiles export` ships them into profiles/methods/lora.yaml).
# The call:   run(command="bash benchmarks/gpu_session6.sh", carry=[".whl"], timeout_s=300)
# A CPU dry run on the tiny models:   GPU_SESSION_DEMO=1 OUT=/tmp/gpu6 bash benchmarks/gpu_session6.sh
source "$(dirname "$0")/gpu_setup.sh"  # OUT, PY, DEMO, log, pack; diffusers and sdplan installed
trap pack EXIT
BENCH_S=${BENCH_S:-100}  # gpu_setup.sh's bench(): each model's limit
for model in sd15 sdxl; do
    bench "$model" memory.gradient_checkpointing=true
done
log "planner vs bench"
$PY benchmarks/bench_vs_planner.py --store "$STORE" >"$OUT/bench_vs_planner.txt" 2>&1
log "done"
