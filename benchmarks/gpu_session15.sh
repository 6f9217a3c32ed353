#!/usr/bin/env bash
# Second call of the 2026-11-27 GPU session (324 s on an H100; benchmarks/results/h100-2026-11-27d.md): more points of the trainer's step under
# DeepSpeed ZeRO-2 (benchmarks/deepspeed_memory.py), after the first call (gpu_session14.sh) found the planner's
# offload peaks 13-31% high. Calibration points only, none of them a validation configuration: SDXL full
# fine-tune at 1024 px batch 4 and at 512 px batch 8 with CPU optimizer offload, SD1.5 at 512 px batch 1 and 16
# with offload, SDXL at 1024 px batch 4 without offload. Needs .whl/ as gpu_session14.sh does.
# The call:   run(command="bash benchmarks/gpu_session15.sh", carry=[".whl"], timeout_s=420)
# CPU dry run:   GPU_SESSION_DEMO=1 DS_ACCELERATOR=cpu OUT=/tmp/gpu15 PY=.venv/bin/python bash benchmarks/gpu_session15.sh
source "$(dirname "$0")/gpu_setup.sh"
trap pack EXIT
deepspeed_setup
RUN_S=180 ds sdxl-1024-b4-offload --model sdxl --method finetune --resolution 1024 --batch 4  # the CPU Adam build
ds sd15-512-b16-offload --model sd15 --method finetune --resolution 512 --batch 16
ds sdxl-512-b8-offload --model sdxl --method finetune --resolution 512 --batch 8
ds sdxl-1024-b4-sharded --model sdxl --method finetune --resolution 1024 --batch 4 --no-offload
ds sd15-512-b1-offload --model sd15 --method finetune --resolution 512 --batch 1
log "done"
