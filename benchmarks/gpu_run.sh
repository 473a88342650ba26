#!/usr/bin/env bash
# Everything that needs a GPU, in one go: the GPU tests, then the kernel, engine, multi-LoRA worker
# and sampler benchmarks. Logs and tables go to $OUT (default ./gpu-results); a summary prints last,
# and the script exits non-zero when any step failed.
#   bash benchmarks/gpu_run.sh [quick]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-results}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
QUICK="${1:-}"
status=()
failed=0
step() {  # step NAME COMMAND...: run, keep the log, remember the exit code
  local name="$1"; shift
  local t0=$SECONDS
  "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  status+=("$name rc=$rc $((SECONDS - t0))s")
  if ((rc != 0)); then failed=1; fi
}
# the `loraserve` namespace maps the top-level folders (setup.py): install it in place, no downloads
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
step gpu-tests python3 -m pytest -q -p no:cacheprovider tests/kernels/test_sgmv_gpu.py \
  tests/inference_worker/engine/test_cuda_engine.py tests/inference_worker/model/test_decode_attention.py \
  tests/inference_worker/lora/test_lora_gpu.py
if [[ "$QUICK" == quick ]]; then
  step kernels python3 benchmarks/bench_kernels.py --quick --no-reference --out "$OUT"
  step engine python3 benchmarks/bench_engine.py --models llama-3.2-1b --batches 1,64 --out "$OUT/engine.md"
  step lora-worker python3 benchmarks/bench_lora_worker.py --shapes 1b --json "$OUT/lora_worker.json"
else
  # --sweep first compares the launch variants (PDL, preloading expand, B vector loads) and keeps
  # the fastest for the table
  step kernels python3 benchmarks/bench_kernels.py --sweep --out "$OUT"
  step engine python3 benchmarks/bench_engine.py --out "$OUT/engine.md"
  step lora-worker python3 benchmarks/bench_lora_worker.py --json "$OUT/lora_worker.json"
fi
step sampler python3 benchmarks/bench_sampler.py --vocab 128256
for f in gpu-tests kernels engine lora-worker sampler; do
  echo "== $f (last lines)"; tail -n 14 "$OUT/$f.log"
done
printf '%s\n' "${status[@]}"
exit "$failed"
