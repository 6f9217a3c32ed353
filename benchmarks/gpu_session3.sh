#!/usr/bin/env bash
# A third GPU call (2026-11-26, after gpu_session2.sh): the settings the biggest out-of-sample misses were run with,
# which `sdplan bench` does not choose by itself (it measures the planner's settings):
#   1. FLUX.1 [dev] LoRA at 1024 px without gradient checkpointing (the reports of out-of-memory on 40-80 GB cards);
#   2. FLUX.1 [dev] LoRA at 512 px with checkpointing;
#   3. SD3.5 Large LoRA at 1024 px without checkpointing;
# and, in a fourth call (BENCHES="flux-dev:512:0 flux-dev:1024:1:0"), FLUX.1 LoRA at 512 px without checkpointing
# (the settings of four out-of-memory reports) and at 1024 px with the text encoders on the GPU.
# (`sdplan bench` takes these as key=value pins since: `sdplan bench --model flux-dev --method lora --quick
# memory.gradient_checkpointing=false`; this script, as run, builds the requests itself.)
# Same set-up and call as gpu_session2.sh:   run(command="bash benchmarks/gpu_session3.sh", carry=[".whl"])
# A CPU dry run:   GPU_SESSION_DEMO=1 OUT=/tmp/gpu3 bash benchmarks/gpu_session3.sh
source "$(dirname "$0")/gpu_setup.sh"
trap pack EXIT
STORE="$OUT/store"
bench() {  # model resolution gc(0|1) [cached TE outputs (1|0), default 1]
    log "bench $*"
    timeout "${BENCH_S:-150}" $PY - "$STORE" "$DEMO" "$@" >>"$OUT/bench.txt" 2>&1 <<'PYEOF'
import sys
from sdplan.bench import BenchRequest, run_bench
store, demo, model, res, gc = sys.argv[1], bool(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5] == "1"
cte = len(sys.argv) < 7 or sys.argv[6] == "1"
req = BenchRequest(method="lora", model=model, resolution=res, precision="bf16", gradient_checkpointing=gc,
                   cache_latents=True, cache_text_encoder_outputs=cte)
for r in run_bench([req], quick=True, store_dir=store, demo=demo, on_result=lambda p: print(p, flush=True)):
    print(r.request.label, "max batch", r.max_batch, r.bounded_by, flush=True)
PYEOF
    echo "exit $?" >>"$OUT/bench.txt"
}
if [ -n "${BENCHES:-}" ]; then  # a later call: BENCHES="flux-dev:512:0 flux-dev:1024:1:0"
    for b in $BENCHES; do bench ${b//:/ }; done
elif [ -n "$DEMO" ]; then
    bench flux-dev 256 0
else
    bench flux-dev 1024 0
    bench flux-dev 512 1
    bench sd35-large 1024 0
fi
log "planner vs bench"
$PY benchmarks/bench_vs_planner.py --store "$STORE" >"$OUT/bench_vs_planner.txt" 2>&1
log "done"
