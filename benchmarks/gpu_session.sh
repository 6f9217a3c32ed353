#!/usr/bin/env bash
# doctor, `sdplan bench` and the planner-vs-measured table on a GPU machine in one scripted run of up to 600 s
# (the first H100 session's measurements, 2026-11-26), results under $OUT.
#
# The GPU machine it was written for has no network and no diffusers: first, here, put the wheel in .whl/
# (git-ignored) and copy it along with the clone:
#   .venv/bin/pip download --no-deps -d .whl "diffusers==$(.venv/bin/python -c 'import diffusers; print(diffusers.__version__)')"
# On the GPU machine, from the clone's root:   OUT=/tmp/gpu-out bash benchmarks/gpu_session.sh
# A CPU dry run of the same script on the tiny demo models:   GPU_SESSION_DEMO=1 OUT=/tmp/gpu-out bash benchmarks/gpu_session.sh
# Python: $PY, else the clone's .venv/bin/python where it exists, else python (benchmarks/gpu_setup.sh).
#
# Each stage has its own time budget and writes as it goes (`sdplan bench` saves every point when measured), so
# a stage that runs out of time still leaves its points; the next stage runs regardless. Budgets (seconds):
# BENCH_S per bench model (2 x 160), TRAIN_S for stage 5 (170), the rest ~60: the script fits a 600 s call.
source "$(dirname "$0")/gpu_setup.sh"  # OUT, PY, DEMO, log, pack; diffusers and sdplan installed

# 2. the real doctor snapshot (a test fixture once committed: tests/fixtures/machines/)
log "doctor"
$SDPLAN doctor --json >"$OUT/doctor.json" 2>"$OUT/doctor.err"
$SDPLAN doctor >"$OUT/doctor.txt" 2>&1

# 3. bench: the largest batch that fits, it/s and peak memory per point, sd15 and sdxl x three methods
STORE="$OUT/store"
if [ -n "$DEMO" ]; then
    log "bench (demo, CPU)"
    timeout 300 $SDPLAN bench --demo --store "$STORE" >"$OUT/bench.txt" 2>&1
else
    for model in sd15 sdxl; do
        log "bench $model"
        timeout "${BENCH_S:-160}" $SDPLAN bench --model "$model" --method lora --method dreambooth \
            --method finetune --quick --store "$STORE" >>"$OUT/bench.txt" 2>&1
        echo "exit $?" >>"$OUT/bench.txt"
    done
fi

# 4. predicted (before: shipped profiles only; leave-one-out) vs measured
log "planner vs bench"
$PY benchmarks/bench_vs_planner.py --store "$STORE" >"$OUT/bench_vs_planner.txt" 2>&1
$PY benchmarks/bench_vs_planner.py --store "$STORE" --json >"$OUT/bench_vs_planner.json" 2>/dev/null

# 5. the trainer on the GPU, which no test machine has: `sdplan train --demo` (the tiny models, LoRA, the real
#    launcher -> trainer path) per family at fp16 and (where the card has it) bf16, with a sample grid during
#    training (sampling.every_steps) and at the end; and one fp16 run with an out-of-memory injected in step 1
#    (trainer/faults.py), which the launcher must retry at batch 1. Lanes run side by side (tiny models);
#    $OUT/train.tsv: run, exit code, peak memory (run_summary.json), OOM retries; $OUT/train/<run>.txt: output.
TRAIN_S=${TRAIN_S:-170}
train_end=$((SECONDS + TRAIN_S))
mkdir -p "$OUT/train"
export SDPLAN_PROFILE_DIR="$OUT/train/store"  # the launcher's observed points stay out of this machine's store
train_run() {  # name, then `sdplan train` arguments
    local name=$1 left=$((train_end - SECONDS)) rc peak retries
    shift
    if [ "$left" -lt 10 ]; then
        printf '%s\tskipped (stage out of time)\t-\t-\n' "$name" >>"$OUT/train.tsv"
        return
    fi
    timeout -k 10 "$left" $SDPLAN train --demo --out "$OUT/train/$name" "$@" >"$OUT/train/$name.txt" 2>&1
    rc=$?
    peak=$($PY -c 'import json, sys; print(json.load(open(sys.argv[1]))["peak_memory_bytes"] // 2**20, "MiB")' \
        "$OUT/train/$name/run_summary.json" 2>/dev/null) || peak="-"
    retries=$(grep -c "^after out of memory" "$OUT/train/$name.txt")
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$peak" "$retries" >>"$OUT/train.tsv"
    # keep what says how it went (summary, OOM report, config, samples); the weights and model go
    find "$OUT/train/$name" -mindepth 1 -maxdepth 1 ! -name run_summary.json ! -name oom.json \
        ! -name sdplan.yaml ! -name samples -exec rm -rf {} + 2>/dev/null
}
printf 'run\texit\tpeak\toom_retries\n' >"$OUT/train.tsv"
if [ -n "$DEMO" ]; then
    log "train (demo, CPU): sd15 with an injected OOM"
    SDPLAN_INJECT_OOM_AT_STEP=1 train_run sd15-oom --model sd15 --max-steps 2 sampling.every_steps=1
else
    log "train on the GPU (demo models)"
    precisions="fp16"
    $PY -c "import sys, torch; sys.exit(0 if torch.cuda.is_bf16_supported() else 1)" 2>/dev/null \
        && precisions="fp16 bf16"
    gpu_args=(--max-steps 4 training.device=cuda sampling.every_steps=2)
    for family in sd15 sdxl sd35 flux; do
        (for p in $precisions; do
            train_run "$family-$p" --model "$family" "${gpu_args[@]}" "training.precision=$p"
        done) &
    done
    (SDPLAN_INJECT_OOM_AT_STEP=1 train_run sd15-fp16-oom --model sd15 "${gpu_args[@]}" training.precision=fp16) &
    wait
fi
{ column -t -s $'\t' "$OUT/train.tsv" 2>/dev/null || cat "$OUT/train.tsv"; } | tee -a "$OUT/session.log"
log "done"
pack
