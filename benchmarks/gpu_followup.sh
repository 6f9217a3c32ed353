#!/usr/bin/env bash
# Second GPU call of 2026-11-26 (after benchmarks/gpu_session.sh): (1) why `sdplan train --demo --model flux`
# hit a NaN loss at step 2 in bf16 on an H100 (fp16 and the CPU were fine): the same run as-is, with SDPA's flash
# kernel off, with math attention only, and under autograd anomaly detection; (2) bench it/s re-measured with the
# minimum timing window (3 timed steps gave it/s off by up to 2x). Results under $OUT, one archive.
set -uo pipefail
: "${OUT:?}"
PY=${PY:-python}
$PY -c "import diffusers" 2>/dev/null || $PY -m pip install -q --no-index --find-links .whl diffusers 2>&1 | tail -3
$PY -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
$PY -c "import sdplan.trainer, diffusers" || exit 1
SDPLAN="$PY -m sdplan.cli"
export SDPLAN_PROFILE_DIR="$OUT/trainstore"
mk_site() {  # folder with a sitecustomize.py running $2 at interpreter start (the trainer is a subprocess)
    mkdir -p "$OUT/site-$1"; printf 'import torch\n%s\n' "$2" >"$OUT/site-$1/sitecustomize.py"; echo "$OUT/site-$1"
}
flux() {  # name, PYTHONPATH or "", extra args
    local name=$1 pp=$2; shift 2
    PYTHONPATH="$pp" timeout 75 $SDPLAN train --demo --model flux --out "$OUT/flux/$name" --max-steps 4 \
        training.device=cuda training.precision=bf16 "$@" >"$OUT/flux-$name.txt" 2>&1
    echo "$name exit $?" >>"$OUT/flux.tsv"
}
flux asis "" sampling.every_steps=2 &
flux nosample "" &
flux noflash "$(mk_site noflash 'torch.backends.cuda.enable_flash_sdp(False)')" &
flux math "$(mk_site math 'torch.backends.cuda.enable_flash_sdp(False); torch.backends.cuda.enable_mem_efficient_sdp(False); torch.backends.cuda.enable_cudnn_sdp(False)')" &
flux anomaly "$(mk_site anomaly 'torch.autograd.set_detect_anomaly(True)')" &
flux fp32 "" training.precision=fp32 &
wait
cat "$OUT/flux.tsv"
timeout 70 $SDPLAN bench --model sd15 --method lora --method dreambooth --quick --store "$OUT/store" >"$OUT/bench.txt" 2>&1
echo "exit $?" >>"$OUT/bench.txt"
timeout 50 $SDPLAN bench --model sdxl --method lora --quick --store "$OUT/store" >>"$OUT/bench.txt" 2>&1
echo "exit $?" >>"$OUT/bench.txt"
grep -E 'batch|exit' "$OUT/bench.txt"
rm -rf "$OUT"/flux/*/base_model "$OUT"/flux/*/dataset
tar czf "$OUT/all.tgz" -C "$OUT" --exclude all.tgz . 2>/dev/null
