#!/usr/bin/env bash
# For the next lent GPU (about 7 minutes on an H100): the trainer's step under DeepSpeed ZeRO-2 in one process
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
demo=${DEMO:+--demo}
if ! $PY -c "import deepspeed" 2>/dev/null; then
    $PY -m pip install -q --no-index --find-links .whl deepspeed 2>&1 | tail -3
fi
{ $PY -c "import deepspeed; print('deepspeed', deepspeed.__version__)"; which g++ c++ nvcc ninja; echo "CUDA_HOME=${CUDA_HOME:-}"; } \
    >>"$OUT/versions.txt" 2>&1
ds() {  # ds NAME ARGS...: one configuration, one process
    local name=$1
    shift
    log "deepspeed $name: $*"
    timeout "${RUN_S:-120}" $PY benchmarks/deepspeed_memory.py $demo "$@" >>"$OUT/deepspeed.json" 2>>"$OUT/deepspeed-$name.err"
    echo "exit $? ($name)" >>"$OUT/deepspeed-$name.err"
    tail -c 3000 "$OUT/deepspeed-$name.err" >"$OUT/deepspeed-$name.tail" && rm -f "$OUT/deepspeed-$name.err"
    pack
}
RUN_S=180 ds sdxl-b1-offload --model sdxl --method finetune --resolution 1024 --batch 1  # the CPU Adam build
ds sdxl-b8-offload --model sdxl --method finetune --resolution 1024 --batch 8
ds sdxl-b1-sharded --model sdxl --method finetune --resolution 1024 --batch 1 --no-offload
ds sd15-b4-offload --model sd15 --method finetune --resolution 512 --batch 4
BENCH_S=100 bench sd15
log "done"
