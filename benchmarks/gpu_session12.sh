#!/usr/bin/env bash
# Ran 2026-11-27 on the lent H100 in 133 s; results in flux_script_memory.py's docstring and profiles/methods/lora.yaml.
# Session 11 found the fault of session 10's run: PyTorch 2.11's cuDNN attention backward ("illegal memory access"
# in mha_graph.execute) in the bare FLUX.1 LoRA script step on the H100. flux_script_memory.py now turns cuDNN
# attention off as sdplan's trainer does; this measures every variant at batch 1 and 2, 512 px (3 steps each,
# the peak from steps 2-3), then the script variant with flash attention alone.
# The call:   run(command="bash benchmarks/gpu_session12.sh", carry=[".whl"], timeout_s=330)
# CPU dry run:   GPU_SESSION_DEMO=1 OUT=/tmp/gpu12 PY=.venv/bin/python bash benchmarks/gpu_session12.sh
source "$(dirname "$0")/gpu_setup.sh"
trap pack EXIT
demo=${DEMO:+--demo}
fsm() {  # fsm NAME ARGS...: one run, its rows to NAME.json, its errors to NAME.err
    local name=$1
    shift
    log "flux script memory $name: $*"
    timeout "${RUN_S:-100}" $PY benchmarks/flux_script_memory.py $demo --json "$@" >"$OUT/$name.json" 2>"$OUT/$name.err"
    echo "exit $?" >>"$OUT/$name.err"
    pack
}
RUN_S=90 fsm script --variants script --batches 1,2
RUN_S=140 fsm variants --variants matched,no-autocast,bf16-lora --batches 1,2
RUN_S=60 fsm flash --variants script --batches 2 --sdpa flash --no-count
log "done"
