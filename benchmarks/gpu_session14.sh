#!/usr/bin/env bash
# Ran on a lent H100 on 2026-11-27 (338 s; benchmarks/results/h100-2026-11-27d.md): the trainer's step under DeepSpeed ZeRO-2 in one process
# (benchmarks/deepspeed_memory.py), never measured on a GPU: SDXL full fine-tune at 1024 px with checkpointing and
# cached latents, batch 1 and 8, with CPU optimizer offload (the validation set's worst peak, SimpleTuner's 4090
# run at batch 8: 12.8 GiB measured, 16.4 predicted) and batch 1 without; SD1.5 at 512, batch 4, with offload.
# Then `sdplan bench --quick` of SD1.5 LoRA, whose end-of-search sample grid has not run on a GPU yet.
# .whl/ must hold diffusers, importlib_metadata and DeepSpeed 0.19.8 with its dependencies for Python 3.12
# (pip wheel deepspeed==0.19.8 --no-deps; pip download --only-binary=:all: --python-version 3.12 einops hjson
# msgpack ninja py-cpuinfo pydantic). DeepSpeed's CPU Adam is compiled on first use: where that fails (no
# compiler or CUDA toolkit on the image) the offload rows record the error, itself a finding.
# The call:   run(command="bash benchmarks/gpu_session14.sh", carry=[".whl"], timeout_s=480)
# CPU dry run:   GPU_SESSION_DEMO=1 DS_ACCELERATOR=cpu OUT=/tmp/gpu14 PY=.venv/bin/python bash benchmarks/gpu_session14.sh
source "$(dirname "$0")/gpu_setup.sh"
trap pack EXIT
deepspeed_setup
RUN_S=180 ds sdxl-b1-offload --model sdxl --method finetune --resolution 1024 --batch 1  # the CPU Adam build
ds sdxl-b8-offload --model sdxl --method finetune --resolution 1024 --batch 8
ds sdxl-b1-sharded --model sdxl --method finetune --resolution 1024 --batch 1 --no-offload
ds sd15-b4-offload --model sd15 --method finetune --resolution 512 --batch 4
BENCH_S=100 bench sd15
log "done"
