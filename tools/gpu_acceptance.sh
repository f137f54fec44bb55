#!/usr/bin/env bash
# The GPU measurements behind the open acceptance points, staged so each fits one device call:
#   source .gpu/prelude.sh; tools/gpu_acceptance.sh STAGE...
# Stages: tests kernels latency offline profile serving. Logs and JSON go to a scratch folder that is
# packed into $OUT/STAGE.tar.gz (the device tool returns few files), and the key lines are
# printed. Every process started here is ended here, by PID.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-out}
mkdir -p "$OUT"

run_stage() {
  local stage=$1 dir
  dir=$(mktemp -d)
  case "$stage" in
    tests)
      $PY -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | tee "$dir/test_gpu.log" | tail -5 ;;
    kernels)
      $PY tools/bench_kernels.py --out "$dir/kernels.json" 2>&1 | tee "$dir/kernels.log" ;;
    offline)
      for mode in "" "--no-async" "--multiprocess" "--multiprocess --no-async"; do
        # shellcheck disable=SC2086
        $PY tools/bench_offline.py $mode --json "$dir/offline${mode// /_}.json" 2>&1 | tail -1
      done
      $PY tools/bench_offline.py --model qwen3-8b --json "$dir/offline_qwen3_8b.json" 2>&1 | tail -1
      ;;
    latency)
      for model in llama-3.1-8b qwen3-8b; do
        $PY tools/bench_latency.py --model $model --json "$dir/latency_$model.json" 2>&1 | tail -1
      done ;;
    profile)
      for mode in "" "--no-async" "--multiprocess" "--multiprocess --no-async"; do
        # shellcheck disable=SC2086
        PYTHON=$PY tools/nsys_profile.sh --out "$dir/prof${mode// /_}" --steps 200:40 -- \
          $PY tools/bench_offline.py $mode 2>&1 | tail -25
      done ;;
    serving)
      local port=8123 pid
      $PY -m echo serve --model qwen3-8b --load-format dummy --port $port \
        --served-model-name qwen3-8b --max-model-len 4096 --log-level warning &
      pid=$!
      for _ in $(seq 600); do
        $PY -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health')" \
          2>/dev/null && break
        kill -0 $pid 2>/dev/null || break
        sleep 1
      done
      $PY tools/bench_serving.py --base-url "http://127.0.0.1:$port" --prompt-type tokens \
        --extra-body '{"return_token_ids": true}' --input-len 128 --output-len 256 --num-prompts 8 --max-concurrency 1 \
        --result-json "$dir/serving_c1.json" --plot-dir "$dir/plots_c1" 2>&1 | tail -25
      $PY tools/bench_serving.py --base-url "http://127.0.0.1:$port" --prompt-type tokens \
        --extra-body '{"return_token_ids": true}' --input-len 1024 --output-len 256 --num-prompts 256 --max-concurrency 64 \
        --result-json "$dir/serving_c64.json" --plot-dir "$dir/plots_c64" 2>&1 | tail -25
      kill -TERM $pid 2>/dev/null
      wait $pid ;;
    *)
      echo "unknown stage $stage" >&2; return 2 ;;
  esac
  tar -czf "$OUT/$stage.tar.gz" -C "$dir" .
  rm -rf "$dir"
}

for stage in "$@"; do
  echo "=== $stage"
  run_stage "$stage"
done
