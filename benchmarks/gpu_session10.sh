#!/usr/bin/env bash
# Ran 2026-11-27 on the lent H100: every variant faulted in its first backward (cuDNN attention under torch 2.11);
# gpu_session11.sh found the kernel, gpu_session12.sh measured with it off (results: flux_script_memory.py).
# For the next lent GPU (about 5 minutes on an H100 80GB): diffusers' FLUX.1 LoRA example's training step,
# written out bare (benchmarks/flux_script_memory.py), at 512 px, batch 1 and 2, no checkpointing: its peak
# allocated memory against sdplan's prediction for those settings with the text encoders resident (44.0 / 53.7
# GiB at batch 1 / 2 incl. T5 and CLIP), and which of the script's choices (fp32 LoRA under autocast, a batch-1
# prompt broadcast to the batch) costs what. diffusers issue 10994 read 78.2 GiB allocated at batch 2 on an
# 80 GB card; on the CPU, a full-width slice of the step saved 9.2 GiB per image for the backward (8.0 without
# autocast and fp32 LoRA, = sdplan's meta count): the step alone does not explain it. The batch-2 script run
# comes last with a CUDA memory snapshot (open it in https://pytorch.org/memory_viz).
# The call:   run(command="bash benchmarks/gpu_session10.sh", carry=[".whl"], timeout_s=420)
# A CPU dry run on the tiny model:   GPU_SESSION_DEMO=1 OUT=/tmp/gpu10 PY=.venv/bin/python bash benchmarks/gpu_session10.sh
source "$(dirname "$0")/gpu_setup.sh"  # OUT, PY, DEMO, log, pack; diffusers and sdplan installed
trap pack EXIT
demo=${DEMO:+--demo}
snap=()
[ -n "$DEMO" ] || snap=(--snapshot "$OUT/snapshots")
for variant in no-autocast bf16-lora matched script; do
    log "flux script memory: $variant"
    timeout "${RUN_S:-150}" $PY benchmarks/flux_script_memory.py $demo --json --variants "$variant" --batches 1,2 \
        "${snap[@]}" >>"$OUT/flux_script_memory.json" 2>>"$OUT/flux_script_memory.err"
    echo "exit $? ($variant)" >>"$OUT/flux_script_memory.err"
    pack
done
log "done"
