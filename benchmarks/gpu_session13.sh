#!/usr/bin/env bash
# The trainer's sample grid, measured (benchmarks/sampling_peak.py): FLUX.1 [dev] LoRA at 1024 px, SDXL at
# 1024, SD1.5 at 512 (bf16, checkpointing, cached latents; FLUX.1 with cached text-encoder outputs), two
# training steps then the final grid's peak, against the planner's sampling_peak (never measured before).
# The call:   run(command="bash benchmarks/gpu_session13.sh", carry=[".whl"], timeout_s=200)
# CPU dry run:   GPU_SESSION_DEMO=1 OUT=/tmp/gpu13 PY=.venv/bin/python bash benchmarks/gpu_session13.sh
source "$(dirname "$0")/gpu_setup.sh"
trap pack EXIT
demo=${DEMO:+--demo}
for cfg in flux-dev:1024:100 sdxl:1024:45 sd15:512:30; do
    IFS=: read -r model res limit <<<"$cfg"
    log "sampling peak $model $res"
    timeout "$limit" $PY benchmarks/sampling_peak.py $demo --json --configs "$model:$res" >>"$OUT/sampling_peak.json" \
        2>>"$OUT/sampling_peak.err"
    echo "exit $? ($model)" >>"$OUT/sampling_peak.err"
    pack
done
log "done"
