#!/usr/bin/env bash
# Everything that needs a GPU, in steps that each fit a 10-minute slot:
#   bash benchmarks/gpu_run.sh tests           # the GPU tests (kernels vs float64, engine, LoRA slots)
#   bash benchmarks/gpu_run.sh kernels         # LoRA step: launch variants A/B, then the table vs cuBLAS
#   bash benchmarks/gpu_run.sh decode          # worker decode, base vs LoRA interleaved; engine vs roofline
#   bash benchmarks/gpu_run.sh sampler         # the batched sampler
#   bash benchmarks/gpu_run.sh bench           # kernels, decode and sampler
# Steps combine (`gpu_run.sh tests kernels`). Logs and tables go to $OUT (default ./gpu-results);
# each step's last lines and a status line per step print last; exit non-zero when a step failed.
# On a machine without a package index, WHEELS=DIR installs the wheels in DIR first (into a
# temporary folder put on PYTHONPATH): a setuptools that reads pyproject.toml, the worker's gRPC
# stack, where the image's are older.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-results}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
(($# > 0)) || set -- tests bench
status=()
ran=()
failed=0
step() {  # step NAME COMMAND...: run, keep the log, remember the exit code
  local name="$1"; shift
  local t0=$SECONDS
  "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  status+=("$name rc=$rc $((SECONDS - t0))s")
  if ((rc != 0)); then failed=1; fi
  ran+=("$name")
}
steps=()
for what in "$@"; do
  case "$what" in
    bench) steps+=(kernels decode sampler) ;;
    tests | kernels | decode | sampler) steps+=("$what") ;;
    *) echo "unknown step: $what (tests, kernels, decode, sampler, bench)"; exit 2 ;;
  esac
done
if [[ -n "${WHEELS:-}" ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/loraserve-wheels \
    "$WHEELS"/*.whl >"$OUT/wheels.log" 2>&1 || { cat "$OUT/wheels.log"; exit 1; }
  export PYTHONPATH="/tmp/loraserve-wheels${PYTHONPATH:+:$PYTHONPATH}"
fi
# the `loraserve` namespace maps the top-level folders (setup.py): install it in place, no downloads
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/gpu.txt"

for what in "${steps[@]}"; do
  case "$what" in
    tests)
      step gpu-tests python3 -m pytest -q -p no:cacheprovider --durations=8 tests/kernels/test_sgmv_gpu.py \
        tests/inference_worker/engine/test_cuda_engine.py tests/inference_worker/model/test_decode_attention.py \
        tests/inference_worker/model/test_prefill_attention.py tests/inference_worker/engine/test_kernel_warmup.py \
        tests/inference_worker/lora/test_lora_gpu.py tests/inference_worker/model/test_skinny_gemm.py \
        tests/inference_worker/model/test_skinny_norm.py tests/inference_worker/model/test_row_argmax.py ;;
    kernels)
      # the launch variants A/B/A/B on the decode configurations, then the table with the fastest
      step kernels python3 benchmarks/bench_kernels.py --sweep --table-configs decode-prefill --no-reference --out "$OUT" ;;
    decode)
      step lora-worker python3 benchmarks/bench_lora_worker.py --json "$OUT/lora_worker.json"
      step engine python3 benchmarks/bench_engine.py --batches-1b 1,64,256 --batches-8b 1,64 --out "$OUT/engine.md" ;;
    sampler)
      step sampler python3 benchmarks/bench_sampler.py --vocab 128256 ;;
  esac
done
for f in "${ran[@]}"; do
  echo "== $f (last lines)"; tail -n 16 "$OUT/$f.log"
done
printf '%s\n' "${status[@]}"
exit "$failed"
