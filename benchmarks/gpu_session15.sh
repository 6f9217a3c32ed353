#!/usr/bin/env bash
# Second call of the 2026-11-27 GPU session (about 5 minutes on an H100): more points of the trainer's step under
# DeepSpeed ZeRO-2 (benchmarks/deepspeed_memory.py), after the first call (gpu_session14.sh) found the planner's
# offload peaks 13-31% high. Calibration points only, none of them a validation configuration: SDXL full
# fine-tune at 1024 px batch 4 and at 512 px batch 8 with CPU optimizer offload, SD1.5 at 512 px batch 1 and 16
# with offload, SDXL at 1024 px batch 4 without offload. Needs .whl/ as gpu_session14.sh does.
# The call:   run(command="bash benchmarks/gpu_session15.sh", carry=[".whl"], timeout_s=420)
# CPU dry run:   GPU_SESSION_DEMO=1 DS_ACCELERATOR=cpu OUT=/tmp/gpu15 PY=.venv/bin/python bash benchmarks/gpu_session15.sh
source "$(dirname "$0")/gpu_setup.sh"
trap pack EXIT
demo=${DEMO:+--demo}
if ! $PY -c "import deepspeed" 2>/dev/null; then
    $PY -m pip install -q --no-index --find-links .whl deepspeed 2>&1 | tail -3
fi
ds() {  # ds NAME ARGS...: one configuration, one process
    local name=$1
    shift
    log "deepspeed $name: $*"
    timeout "${RUN_S:-120}" $PY benchmarks/deepspeed_memory.py $demo "$@" >>"$OUT/deepspeed.json" 2>>"$OUT/deepspeed-$name.err"
    echo "exit $? ($name)" >>"$OUT/deepspeed-$name.err"
    tail -c 1500 "$OUT/deepspeed-$name.err" >"$OUT/deepspeed-$name.tail" && rm -f "$OUT/deepspeed-$name.err"
    pack
}
RUN_S=180 ds sdxl-1024-b4-offload --model sdxl --method finetune --resolution 1024 --batch 4  # the CPU Adam build
ds sd15-512-b16-offload --model sd15 --method finetune --resolution 512 --batch 16
ds sdxl-512-b8-offload --model sdxl --method finetune --resolution 512 --batch 8
ds sdxl-1024-b4-sharded --model sdxl --method finetune --resolution 1024 --batch 4 --no-offload
ds sd15-512-b1-offload --model sd15 --method finetune --resolution 512 --batch 1
log "done"
