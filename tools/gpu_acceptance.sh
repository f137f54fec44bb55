#!/usr/bin/env bash
# The GPU measurements behind the open acceptance points, staged so each fits one device call:
#   source .gpu/prelude.sh; tools/gpu_acceptance.sh STAGE...
# Stages: tests (or tests-kernels, then tests-rest), kernels latency batch1 offline profile
# profile-tail serving int8-pool kv-offload kv-offload-repeat structured awq awq-mma
# awq-mma-steps moe persistent persistent-models persistent-awq ab-latency, and tp and
# profile-tp (two GPUs). Rough minutes on an H200:
# tests 14 (two calls: tests-kernels 7, tests-rest 7, on a machine just started), kernels 2,
# latency 3, batch1 5 (3.5 on an H100 before its second AWQ run), offline 5, profile 5,
# profile-tail 2, serving 4, int8-pool 2, kv-offload 7, kv-offload-repeat 3, structured 4, awq 8,
# awq-mma 5 and awq-mma-steps 5 (guesses: their parts ran on an H100 in 2-4 minutes each), moe 6,
# persistent 6, persistent-models 8 and persistent-awq 8 (a guess: not yet run), ab-latency 1
# a model and tree (a guess), tp 6 (plus start-up): pick
# what fits the device budget. Logs and JSON go to a scratch folder that is packed into $OUT/STAGE.tar.gz (the
# device tool returns few files), and the key lines are printed. Every process started here is ended here, by PID.
# The probes' runs: tools/dev/gpu_probes.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
source tools/gpu_stages.sh

persistent_latency() {  # DIR MODEL FLAGS...: bench_latency once per set of flags
  local dir=$1 model=$2 flags
  shift 2
  for flags in "$@"; do
    echo "$model $flags"
    # shellcheck disable=SC2086
    timeout 300 $PY tools/bench_latency.py --model "$model" --max-model-len 2048 --iters 2 \
      $flags --json "$dir/latency_${model}${flags// /_}.json" 2>&1 | tail -1
  done
}

multiturn_round() {  # DIR ROUND LIMIT...: later turns' TTFT without the tier, then with it
  # (staged copies) for each join limit against that run; limit 0: early loads off
  local dir=$1 round=$2 limit early
  shift 2
  ECHO_KV_COPY_MODE=staged $PY tools/bench_multiturn.py --model qwen3-8b \
    --num-gpu-blocks-override 1500 --json "$dir/multiturn_none_$round.json" 2>&1 | tail -1
  for limit in "$@"; do
    early=$(( limit > 0 ))
    echo "round $round: --kv-offloading-size 16, ECHO_KV_EARLY_LOADS=$early, joined limit $limit"
    ECHO_KV_EARLY_LOADS=$early ECHO_KV_JOINED_LOAD_BLOCKS=$limit ECHO_KV_COPY_MODE=staged \
      $PY tools/bench_multiturn.py --model qwen3-8b --num-gpu-blocks-override 1500 \
      --kv-offloading-size 16 --json "$dir/multiturn_tier_limit${limit}_$round.json" \
      --against "$dir/multiturn_none_$round.json" 2>&1 | tail -2
  done
}

readonly AB_TREES_DIR=/tmp/ab-trees  # where the ab-latency stage unpacks AB_BASE's tars

in_ab_tree() {  # TREE COMMAND...: in one of the ab-latency stage's unpacked trees, or "this"
  local tree=$1
  shift
  (if [ "$tree" != this ]; then cd "$AB_TREES_DIR/$tree" || exit; fi
   PYTHONPATH=/tmp/site:$PWD "$@")
}

stage_commands() {
  local stage=$1 dir=$2
  case "$stage" in
    tests|tests-kernels|tests-rest)  # one line a failure, so its cause comes back in the tail
      local where=(tests)
      [ "$stage" = tests-kernels ] && where=(tests/kernels)
      [ "$stage" = tests-rest ] && where=(tests --ignore=tests/kernels)
      $PY -m pytest -m gpu -q -p no:cacheprovider --tb=line -rfE "${where[@]}" 2>&1 \
        | tee "$dir/test_gpu.log" | tail -15 ;;
    kernels)
      $PY tools/bench_kernels.py --out "$dir/kernels.json" 2>&1 | tee "$dir/kernels.log" ;;
    tp)  # PDL and the one-row GEMV tuning are on by default
      $PY -m pytest -m gpu -q -p no:cacheprovider tests/engine/test_multiprocess.py -k gpu_worker \
        2>&1 | tail -2
      echo "ECHO_FUSED_NORM_ALL_REDUCE=0"  # NCCL, then the add + RMSNorm
      ECHO_FUSED_NORM_ALL_REDUCE=0 $PY -m pytest -m gpu -q -p no:cacheprovider \
        tests/engine/test_multiprocess.py -k gpu_worker 2>&1 | tail -2
      $PY tools/bench_all_reduce.py --json "$dir/all_reduce.json" 2>&1 | tail -6
      for flags in "ECHO_FUSED_NORM_ALL_REDUCE=1" "ECHO_FUSED_NORM_ALL_REDUCE=0" \
                   "ECHO_SYMM_MEM_ALL_REDUCE=1 ECHO_FUSED_NORM_ALL_REDUCE=0"; do
        echo "$flags"
        # shellcheck disable=SC2086
        env $flags $PY tools/bench_latency.py --model qwen3-8b --tp 2 \
          --json "$dir/latency_tp2_${flags// /_}.json" 2>&1 | tail -1
      done
      # the same step without communication: one rank's share on one GPU
      $PY tools/bench_latency.py --model qwen3-8b --rank-share-of 2 \
        --json "$dir/latency_rank_share_of_2.json" 2>&1 | tail -1
      for run in "1" "2" "2 --multiprocess"; do
        # shellcheck disable=SC2086
        $PY tools/bench_offline.py --model qwen3-8b --tp $run \
          --json "$dir/offline_tp${run// /_}.json" 2>&1 | tail -1
      done
      ECHO_FUSED_NORM_ALL_REDUCE=0 $PY tools/bench_offline.py --model qwen3-8b --tp 2 \
        --json "$dir/offline_tp2_nccl_norm.json" 2>&1 | tail -1 ;;
    offline)
      for mode in "" "--multiprocess" "--engine-process" "--kv-cache-dtype int8" \
                  "--multiprocess --kv-cache-dtype int8"; do
        # shellcheck disable=SC2086
        $PY tools/bench_offline.py $mode --json "$dir/offline${mode// /_}.json" 2>&1 | tail -1
      done
      # PDL slowed back-to-back decode launches at B=64 x 4K in bench_kernels: does it cost here?
      ECHO_PDL=0 $PY tools/bench_offline.py --json "$dir/offline_pdl0.json" 2>&1 | tail -1
      $PY tools/bench_offline.py --model qwen3-8b --json "$dir/offline_qwen3_8b.json" 2>&1 | tail -1
      ;;
    int8-pool)  # offline-like decode (Qwen3-0.6B heads, its contexts at step 200) over a
      # cache just as large as the batch, and over pools just under and past 2^31 elements (the
      # engine's int8 pool on an H200 holds 138,234 blocks; offsets then count from its middle)
      for pool in 0 131000 140000; do
        $PY tools/bench_kernels.py --only decode --decode-heads 16:8 --decode-cases 256:300-1224 \
          --decode-pool-blocks $pool 2>&1 | grep "cuda graph"
      done ;;
    latency)  # batch 1, with the one-row GEMV tuning (worker/linear_tuning.py) and PDL
      for model in llama-3.1-8b qwen3-8b; do
        for tune in 0 1; do
          for pdl in 0 1; do
            echo "ECHO_TUNE_SMALL_M=$tune ECHO_PDL=$pdl"
            ECHO_TUNE_SMALL_M=$tune ECHO_PDL=$pdl $PY tools/bench_latency.py --model $model \
              --json "$dir/latency_${model}_tune${tune}_pdl$pdl.json" 2>&1 | grep -E "decode"
          done
        done
      done ;;
    profile)
      for mode in "" "--no-async" "--multiprocess" "--multiprocess --no-async"; do
        # shellcheck disable=SC2086
        PYTHON=$PY tools/nsys_profile.sh --out "$dir/prof${mode// /_}" --steps 200:40 -- \
          $PY tools/bench_offline.py $mode 2>&1 | tail -25
      done ;;
    profile-tp)  # two GPUs: where a TP=2 batch-1 step spends its time, per rank
      PYTHON=$PY tools/nsys_profile.sh --out "$dir/prof_tp2" --steps 100:40 -- \
        $PY tools/bench_latency.py --model qwen3-8b --tp 2 --iters 1 2>&1 | tail -40 ;;
    profile-tail)  # fewer requests left: GPU steps shorter than the host's work per step
      for mode in "" "--multiprocess"; do
        # shellcheck disable=SC2086
        PYTHON=$PY tools/nsys_profile.sh --out "$dir/prof_tail${mode// /_}" --steps 800:40 -- \
          $PY tools/bench_offline.py $mode 2>&1 | grep -E "GPU busy|gaps|step period|tok/s"
      done ;;
    serving)
      local port=8123 pid
      # SERVE_ARGS: more server flags, e.g. SERVE_ARGS="--tp 2" on two GPUs
      # shellcheck disable=SC2086
      $PY -m echo serve --model qwen3-8b --load-format dummy --port $port \
        --served-model-name qwen3-8b --max-model-len 4096 --log-level warning ${SERVE_ARGS:-} &
      pid=$!
      for _ in $(seq 600); do
        $PY -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health')" \
          2>/dev/null && break
        kill -0 $pid 2>/dev/null || break
        sleep 1
      done
      local common=(--base-url "http://127.0.0.1:$port" --prompt-type tokens
                    --extra-body '{"return_token_ids": true}')
      $PY tools/bench_serving.py "${common[@]}" --input-len 128 --output-len 256 \
        --num-prompts 8 --max-concurrency 1 --result-json "$dir/serving_c1.json" \
        --plot-dir "$dir/plots_c1" 2>&1 | tail -25
      # all 64 at once: the last of the burst waits for 64 x 1024 prompt tokens of prefill.
      # Each run draws its own prompts (--seed): a run repeating an earlier one's prompts
      # would find them in the prefix cache.
      $PY tools/bench_serving.py "${common[@]}" --input-len 1024 --output-len 256 \
        --num-prompts 256 --max-concurrency 64 --seed 1 --result-json "$dir/serving_c64.json" \
        --plot-dir "$dir/plots_c64" 2>&1 | tail -25
      # the same cap with Poisson arrivals near the throughput: steady state, no start burst
      $PY tools/bench_serving.py "${common[@]}" --input-len 1024 --output-len 256 \
        --num-prompts 256 --max-concurrency 64 --request-rate 10 --seed 2 \
        --result-json "$dir/serving_c64_rate10.json" --plot-dir "$dir/plots_c64_rate10" \
        2>&1 | tail -25
      kill -TERM $pid 2>/dev/null
      wait $pid ;;
    kv-offload)  # #29: loads beside decoders and against pinned copies; later turns' TTFT
      # with the GPU pool about a quarter of the conversations' final working set
      ECHO_KV_EARLY_LOADS=0 $PY tools/bench_kv_load_decode.py --model qwen3-8b \
        --json "$dir/kv_load_decode.json" 2>&1 | tail -30
      # early loads (small loads into blocks no step in flight uses start beside that step and
      # run their request in the step that carries them: joined), the default since
      # 2026-12-06: the decoders beside its loads (32K-token histories: none joined)
      echo "ECHO_KV_EARLY_LOADS=1 bench_kv_load_decode"
      ECHO_KV_EARLY_LOADS=1 $PY tools/bench_kv_load_decode.py --model qwen3-8b \
        --json "$dir/kv_load_decode_early.json" 2>&1 | grep -E "decode_ratio|transfer_gb"
      multiturn_round "$dir" 1 0 128 192
      $PY tools/dev/kv_offload_verdict.py "$dir" ;;
    kv-offload-repeat)  # #29: a second round of kv-offload's TTFT runs (a run's later-turn p50
      # moved by ~40 ms between calls on 2026-12-05)
      multiturn_round "$dir" 2 128 192
      $PY tools/dev/kv_offload_verdict.py "$dir" ;;
    structured)  # #25: the constrained decode step, the core's grammar work, and a profile
      local tok=${TOKENIZER:+--tokenizer $TOKENIZER}  # a folder with SmolLM2's tokenizer files
      $PY tools/dev/probe_grammar_step.py $tok 2>&1 | tail -1
      $PY tools/bench_structured.py --skip-offline --engine-process $tok \
        --json "$dir/structured_core_process.json" 2>&1 | tail -1
      ECHO_NVTX=1 $PY tools/bench_structured.py --skip-offline $tok --profile "$dir/prof" 2>&1 | tail -3
      $PY tools/overlap_report.py "$dir/prof/constrained.json.gz" --out "$dir/report_constrained" \
        --steps-with bitmask 2>&1 | head -30
      $PY tools/overlap_report.py "$dir/prof/free.json.gz" --out "$dir/report_free" 2>&1 \
        | head -30
      rm -rf "$dir/prof" ;;  # tens of MB: the reports keep what they found
    awq)  # #30: the AWQ tests, kernels, batch-1 decode against bf16, offline with AWQ weights
      $PY -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_awq.py \
        tests/models/test_awq_models.py 2>&1 | tail -2
      $PY tools/bench_kernels.py --only awq --out "$dir/kernels_awq.json" 2>&1 \
        | tee "$dir/kernels_awq.log" | grep -E "awq|torch linear"
      for model in llama-3.1-8b llama-3.1-8b-awq qwen3-8b qwen3-8b-awq; do
        $PY tools/bench_latency.py --model $model --iters 2 \
          --json "$dir/latency_$model.json" 2>&1 | grep -E "decode"
      done
      for model in qwen3-8b qwen3-8b-awq; do
        $PY tools/bench_offline.py --model $model --json "$dir/offline_$model.json" 2>&1 \
          | tail -1
      done ;;
    moe)  # #28: the MoE tests, fused_moe's rows, batch-1 decode, offline, transformers' forward
      $PY -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_fused_moe.py \
        tests/models/test_qwen3_moe.py 2>&1 | tail -2
      $PY tools/bench_kernels.py --only moe --out "$dir/kernels_moe.json" 2>&1 \
        | tee "$dir/kernels_moe.log" | grep -E "^(fused_moe|router)"
      $PY tools/bench_latency.py --model qwen3-30b-a3b --iters 2 \
        --json "$dir/latency_qwen3-30b-a3b.json" 2>&1 | grep -E "decode"
      $PY tools/bench_offline.py --model qwen3-30b-a3b --json "$dir/offline_moe.json" 2>&1 \
        | tail -1
      $PY tools/bench_hf_reference.py --model qwen3-30b-a3b 2>&1 | tail -2 ;;
    persistent)  # #27: the persistent decode step's tests (first: a hang shows before the
      # benches), the kernel alone over tile settings, then Qwen3-0.6B batch 1 with it and
      # without, one and eight steps a launch
      timeout 300 $PY -m pytest -m gpu -q -p no:cacheprovider \
        tests/kernels/test_persistent_decode.py tests/worker/test_persistent_decoder.py \
        2>&1 | tail -3
      timeout 240 $PY tools/dev/probe_persistent_decode.py --model qwen3-0.6b 2>&1 \
        | tee "$dir/probe_persistent_qwen3-0.6b.log"
      persistent_latency "$dir" qwen3-0.6b "" "--persistent-decode" "--num-scheduler-steps 8" \
        "--num-scheduler-steps 8 --persistent-decode" ;;
    batch1)  # the batch-1 figures of record in one call, the defaults: #27's small models
      # and its Llama-3.1-8B guard, #28's Qwen3-30B-A3B, #30's AWQ against bf16 (with the
      # one-row tuning's choices, which its log lines print); AWQ also 8 steps a launch, where
      # the host's ~1.1-1.7 ms a step (an H100, 2026-12-07) stays far from a ~2 ms step
      for run in "qwen3-0.6b 8" "stories110m 8" "llama-3.1-8b 1" "qwen3-30b-a3b 8" \
          "llama-3.1-8b-awq 1" "llama-3.1-8b-awq 8"; do
        set -- $run
        echo "$1, $2 steps a launch"
        timeout 300 $PY tools/bench_latency.py --model "$1" --max-model-len 2048 --iters 2 \
          --num-scheduler-steps "$2" --json "$dir/latency_$1_$2.json" > "$dir/latency_$1_$2.log" 2>&1
        grep -E "one-row linear|decode" "$dir/latency_$1_$2.log" | tail -6
      done ;;
    awq-mma)  # #30: the tensor-core AWQ layout (ECHO_AWQ_MMA, default 1): its GPU tests, the
      # GEMV's settings at 1 and 4 rows with its splits summed by a launch or inside, its GEMM
      # at 64-128 rows against awq_gemm and the dense weight
      timeout 150 $PY -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_awq_mma.py \
        2>&1 | tail -2
      timeout 200 $PY tools/dev/probe_awq_mma_gemv.py --rows 1,4 --configs 4x1,4x2 --per-sm 8,4 \
        --fused-sum 0,1 2>&1 | tee "$dir/probe_awq_mma_gemv.log" \
        | grep -E "awq_linear|mma"
      timeout 200 $PY tools/dev/probe_awq_gemm_rows.py --rows 64,128 2>&1 \
        | tee "$dir/probe_awq_gemm_rows.log" ;;
    awq-mma-steps)  # #30: Llama-3.1-8B AWQ steps at batch 1-96 and Qwen3-8B AWQ offline with
      # the tensor-core layout and without, alternately; at batch 1 and 4 also the tensor-core
      # GEMV's splits summed by a second launch (ECHO_AWQ_SUM_INSIDE=0, "launch")
      local batch mma
      for batch in 1 4 16 96; do
        for mma in 0 1 launch; do
          [ "$mma" = launch ] && [ "$batch" -gt 4 ] && continue
          echo "batch $batch, ECHO_AWQ_MMA=$mma"
          ECHO_AWQ_MMA=${mma/launch/1} ECHO_AWQ_SUM_INSIDE=$([ "$mma" = launch ] && echo 0 || echo 1) \
            timeout 150 $PY tools/bench_latency.py --model llama-3.1-8b-awq \
            --max-model-len 2048 --iters 2 --num-scheduler-steps 8 --batch-size $batch \
            --json "$dir/latency_b${batch}_mma$mma.json" 2>&1 | grep -E "decode"
        done
      done
      for mma in 1 0; do
        echo "offline, ECHO_AWQ_MMA=$mma"
        ECHO_AWQ_MMA=$mma timeout 200 $PY tools/bench_offline.py --model qwen3-8b-awq \
          --json "$dir/offline_awq_mma$mma.json" 2>&1 | tail -1
      done ;;
    persistent-models)  # #27, #28: the other models, eight steps a launch, with it and without
      for model in stories110m llama-3.1-8b qwen3-30b-a3b; do
        persistent_latency "$dir" $model "--num-scheduler-steps 8" \
          "--num-scheduler-steps 8 --persistent-decode"
      done
      timeout 240 $PY tools/dev/probe_persistent_decode.py --model qwen3-30b-a3b 2>&1 \
        | tee "$dir/probe_persistent_qwen3-30b-a3b.log" ;;
    persistent-awq)  # #30: AWQ linear layers in the persistent step: their GPU tests, the
      # kernel alone over the AWQ settings, batch 1 against bf16 with it and without
      timeout 300 $PY -m pytest -m gpu -q -p no:cacheprovider -k awq \
        tests/kernels/test_persistent_decode.py tests/worker/test_persistent_decoder.py \
        2>&1 | tail -3
      timeout 240 $PY tools/dev/probe_persistent_decode.py --model llama-3.1-8b \
        --awq-group 128 2>&1 | tee "$dir/probe_persistent_llama-3.1-8b-awq.log"
      persistent_latency "$dir" llama-3.1-8b ""
      for model in llama-3.1-8b-awq qwen3-8b-awq; do
        persistent_latency "$dir" $model "" "--persistent-decode" \
          "--num-scheduler-steps 8 --persistent-decode"
      done ;;
    ab-latency)  # this tree against other commits', batch 1, alternately, twice each:
      # AB_BASE (a `git archive` tar of each, made beside this tree before the call, e.g.
      # `git archive -o .gpu/base.tar REV` and carried in .gpu; several tars, space-separated,
      # are trees named by their files, base.tar "base"), AB_MODELS (default
      # llama-3.1-8b-awq), AB_STEPS (steps a launch, default 8), AB_MAX_MODEL_LEN (default
      # 2048: the decode graphs' key bound, so their split count); AB_TESTS: test paths or ids
      # (no spaces inside one) for this tree's GPU tests, run first; AB_PROBE: a tools/dev
      # script and its arguments, run in each tree, this one last, before the steps
      local model tree tar trees=()
      # the whole report into the stage's tar (its failures' tracebacks), the summary here
      # shellcheck disable=SC2086
      [ -n "${AB_TESTS:-}" ] && timeout 300 $PY -m pytest -m gpu -q -p no:cacheprovider \
        --tb=short -rfE $AB_TESTS 2>&1 | tee "$dir/ab_tests.log" | tail -4
      rm -rf $AB_TREES_DIR
      for tar in ${AB_BASE:?a git archive tar}; do
        tree=$(basename "$tar" .tar)
        mkdir -p "$AB_TREES_DIR/$tree" && tar -xf "$tar" -C "$AB_TREES_DIR/$tree"
        trees+=("$tree")
      done
      trees+=(this)
      if [ -n "${AB_PROBE:-}" ]; then
        for tree in "${trees[@]}"; do
          echo "$AB_PROBE, $tree tree"
          # shellcheck disable=SC2086
          in_ab_tree $tree timeout 200 $PY tools/dev/$AB_PROBE 2>&1 \
            | tee -a "$dir/probe_$tree.log" | tail -40
        done
      fi
      for model in ${AB_MODELS:-llama-3.1-8b-awq}; do
        for tree in "${trees[@]}" "${trees[@]}"; do
          echo "$model, $tree tree"
          in_ab_tree $tree timeout 150 $PY tools/bench_latency.py --model $model \
            --max-model-len "${AB_MAX_MODEL_LEN:-2048}" --iters 2 \
            --num-scheduler-steps "${AB_STEPS:-8}" \
            2>&1 | tee -a "$dir/latency_${model}_$tree.log" | grep -E "one-row|decode"
        done
      done
      rm -rf $AB_TREES_DIR ;;
    *)
      echo "unknown stage $stage" >&2; return 2 ;;
  esac
}

run_stages "$@"
