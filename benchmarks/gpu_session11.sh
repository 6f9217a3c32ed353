#!/usr/bin/env bash
# Ran 2026-11-27 (H100): 1. the fault is cuDNN attention's backward (mha_graph.execute is_good() false); 2. it faults
# without the hooks too; 3. each forced backend said "No available kernel" because the restriction also covered
# the CLIP encoder's masked attention (--sdpa now applies to the training step alone).
# Session 10's run of benchmarks/flux_script_memory.py stopped with "CUDA error: an illegal memory access" in the
# first backward of every variant (H100, torch 2.11.0+cu130), while sdplan's own trainer trains FLUX.1 LoRA on
# that image. This finds which part of the bare script step does it, then measures what runs:
#   1. CUDA_LAUNCH_BLOCKING=1: the op that faults;  2. without the saved-tensor hooks;  3. each SDPA backend;
#   4. every variant at batch 1, 2 with whatever ran (snapshot of the script variant).
# The call:   run(command="bash benchmarks/gpu_session11.sh", carry=[".whl"], timeout_s=400)
# CPU dry run:   GPU_SESSION_DEMO=1 OUT=/tmp/gpu11 PY=.venv/bin/python bash benchmarks/gpu_session11.sh
source "$(dirname "$0")/gpu_setup.sh"
trap pack EXIT
demo=${DEMO:+--demo}
fsm() {  # fsm NAME ARGS...: one run, its rows to NAME.json, its errors to NAME.err; returns its exit status
    local name=$1
    shift
    log "flux script memory $name: $*"
    timeout "${RUN_S:-100}" $PY benchmarks/flux_script_memory.py $demo --json "$@" >"$OUT/$name.json" 2>"$OUT/$name.err"
    local rc=$?
    echo "exit $rc" >>"$OUT/$name.err"
    pack
    return $rc
}
CUDA_LAUNCH_BLOCKING=1 fsm blocking --variants no-autocast --batches 1 --steps 2
ok=()
fsm nocount --variants no-autocast --batches 1 --steps 2 --no-count && ok=(--no-count)
if [ ${#ok[@]} -eq 0 ]; then
    for b in efficient flash cudnn; do
        fsm "sdpa-$b" --variants no-autocast --batches 1 --steps 2 --sdpa "$b" && { ok=(--sdpa "$b"); break; }
        fsm "sdpa-$b-nocount" --variants no-autocast --batches 1 --steps 2 --sdpa "$b" --no-count \
            && { ok=(--sdpa "$b" --no-count); break; }
    done
fi
if [ ${#ok[@]} -gt 0 ]; then
    snap=()
    [ -n "$DEMO" ] || snap=(--snapshot "$OUT/snapshots")
    RUN_S=200 fsm variants --variants no-autocast,bf16-lora,matched --batches 1,2 "${ok[@]}"
    RUN_S=100 fsm script --variants script --batches 1,2 "${ok[@]}" "${snap[@]}"
fi
log "done"
