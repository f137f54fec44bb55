#!/usr/bin/env bash
# The GPU runs behind the probes in this folder (README.md: what each answered), staged like
# tools/gpu_acceptance.sh so each fits one device call:
#   source .gpu/prelude.sh; tools/dev/gpu_probes.sh STAGE...
# Stages, rough minutes on an H200 (plus start-up): sweeps 5, int8-probe 2, l2-prefetch 2,
# kv-contention 4, kv-trace 7, kv-split 7, step-copies 8, offload-kernel 8,
# layer-l2 2, gemv-shares 2.
# Logs and JSON go to a scratch folder that is packed into $OUT/STAGE.tar.gz, and the key lines
# are printed.
set -uo pipefail
cd "$(dirname "$0")/../.."
source tools/gpu_stages.sh

stage_commands() {
  local stage=$1 dir=$2
  case "$stage" in
    sweeps)  # tile candidates: int8 decode (the int8 issue's case) and small-M linears
      $PY tools/bench_kernels.py --only decode --decode-cases 8:32768 --sweep \
        --out "$dir/decode_sweep.json" > "$dir/decode_sweep.log" 2>&1
      $PY tools/bench_kernels.py --only linear --sweep --out "$dir/linear_sweep.json" \
        > "$dir/linear_sweep.log" 2>&1
      $PY tools/dev/sweep_summary.py "$dir/decode_sweep.json" "$dir/linear_sweep.json" ;;
    int8-probe)  # what paged_attention adds to the stripped loop: scales, PDL, launch order
      $PY tools/dev/int8_v_layout_probe.py --experiment overheads 2>&1 | tee "$dir/overheads.log"
      for pdl in 1 0; do
        echo "ECHO_PDL=$pdl"
        ECHO_PDL=$pdl $PY tools/bench_kernels.py --only decode --decode-cases 8:32768,256:1024 \
          2>&1 | grep "cuda graph"
      done ;;
    l2-prefetch)  # the next GEMV's weight prefetched into the L2 during a short kernel, whole
      # rows or every row's first bytes (neither paid in the engine, docs/benchmarks.md)
      for tp in 1 2; do
        $PY tools/dev/bench_l2_prefetch.py --tp $tp --json "$dir/l2_prefetch_tp$tp.json" 2>&1 \
          | tee "$dir/l2_prefetch_tp$tp.log"
      done ;;
    kv-contention)  # why decoders slow beside host-tier loads: the device side, then the host
      $PY tools/dev/probe_copy_contention.py 2>&1 | tee "$dir/copy_contention.log"
      $PY tools/dev/probe_kv_load_stall.py --model qwen3-8b 2>&1 \
        | tee "$dir/kv_load_stall.log" | grep -E "chunks of|ratio|p50|gb_per|calls|load timeline|longest gaps" ;;
    kv-trace)  # the decoders' kernels with and without loads in flight, then with the engine
      # on a stream of the highest priority (the tier's side stream keeps the lowest), then
      # without PDL (do kernels launched early, waiting on their predecessor, lose their SMs
      # to the tier's scatters? the contention probe's GEMMs ran without PDL)
      for variant in "1" "1 --high-priority" "0"; do
        set -- $variant
        local pdl=$1 name="trace_pdl$1${2:-}"
        echo "--- ECHO_PDL=$pdl ${2:-}"
        ECHO_PDL=$pdl $PY tools/dev/probe_kv_load_trace.py --out "$dir/$name" ${2:-} \
          > "$dir/$name.log" 2>&1
        grep -v "^echo:" "$dir/$name.log" \
          | grep -E "decode_ratio|p50|gb_per_s\"|priority|^==|^   |^kernels"
      done ;;
    kv-split)  # the host tier's copy modes (ECHO_KV_COPY_MODE): its GPU tests, then the
      # decoders beside loads, staged on one side stream, split over two, and direct (strided
      # copies, no staging or kernels), by chunk size
      $PY -m pytest -m gpu -q tests/worker/test_kv_transfer.py tests/worker/test_strided_copy.py \
        2>&1 | tail -3
      for run in "64 2 staged" "64 2 split" "64 2 direct" "16 4 split" "16 4 direct"; do
        set -- $run
        $PY tools/dev/probe_kv_load_stall.py --model qwen3-8b --chunk-blocks $1 \
          --chunks-in-flight $2 --copy-mode $3 > "$dir/stall_$1_$2_$3.log" 2>&1
        grep -E "chunks of|decode_ratio|p50|gb_per_s\"|load timeline|longest gaps" "$dir/stall_$1_$2_$3.log"
      done ;;
    step-copies)  # a step's own copies by kernel (ECHO_STEP_COPIES) beside the host tier's:
      # the GPU tests, the contention probe (uploads behind the tier's copies), then the
      # decoders beside loads with the step's copies by the copy engine and by kernel
      $PY -m pytest -m gpu -q tests/kernels/test_host_copy.py tests/worker/test_pinned_ring.py \
        tests/worker/test_gpu_runner.py::test_step_copies_by_kernel_give_the_same_tokens 2>&1 \
        | tail -3
      $PY tools/dev/probe_copy_contention.py --cache-blocks 9632 2>&1 \
        | tee "$dir/copy_contention.log" | grep -E "upload|alone"
      for run in "64 2 staged engine" "64 2 staged kernel" "64 2 direct kernel" \
          "16 4 staged kernel"; do
        set -- $run
        ECHO_STEP_COPIES=$4 $PY tools/dev/probe_kv_load_stall.py --model qwen3-8b \
          --chunk-blocks $1 --chunks-in-flight $2 --copy-mode $3 > "$dir/stall_$1_$2_$3_$4.log" 2>&1
        echo "$run"
        grep -E "decode_ratio|p50|gb_per_s\"|gb_per_s_wall|load timeline|longest gaps" "$dir/stall_$1_$2_$3_$4.log"
      done ;;
    offload-kernel)  # step-copies in one call where the device is scarce: the GPU tests of
      # copies by kernel, the decoders beside staged loads with engine copies and beside direct
      # loads with kernel copies, then later turns' TTFT without and with the tier, both with
      # kernel copies and the tier's copies direct
      $PY -m pytest -m gpu -q tests/kernels/test_host_copy.py tests/worker/test_pinned_ring.py \
        tests/worker/test_gpu_runner.py::test_step_copies_by_kernel_give_the_same_tokens 2>&1 \
        | tail -3
      for run in "staged engine" "direct kernel"; do
        set -- $run
        ECHO_STEP_COPIES=$2 $PY tools/dev/probe_kv_load_stall.py --model qwen3-8b \
          --copy-mode $1 > "$dir/stall_$1_$2.log" 2>&1
        echo "$run"
        grep -E "decode_ratio|p50|gb_per_s\"|gb_per_s_wall|load timeline|longest gaps" "$dir/stall_$1_$2.log"
      done
      for tier in "" "--kv-offloading-size 16"; do
        echo "tier: ${tier:-none}"
        # shellcheck disable=SC2086
        ECHO_STEP_COPIES=kernel ECHO_KV_COPY_MODE=direct $PY tools/bench_multiturn.py \
          --model qwen3-8b --num-gpu-blocks-override 1500 $tier \
          --json "$dir/multiturn${tier:+_tier}.json" \
          ${tier:+--against "$dir/multiturn.json"} 2>&1 | tail -9
      done ;;
    layer-l2)  # the next layer's weights streamed into the L2 beside the current layer, on a
      # stream forked in the graph (Qwen3-0.6B's GEMV chain, a spin for attention)
      for spin in 8 0; do
        $PY tools/dev/probe_layer_l2_prefetch.py --spin-us $spin 2>&1 | tee -a "$dir/layer_l2.log"
      done ;;
    gemv-shares)  # #27: Qwen3-0.6B's 112 GEMVs in one launch, each program's whole share of
      # the next GEMV requested before the grid barrier, against the launch chain and the
      # tile-at-a-time persistent chain
      timeout 300 $PY tools/dev/probe_persistent_gemv.py --programs-per-sm 2,3 2>&1 \
        | tee "$dir/gemv_shares.log" ;;
    *)
      echo "unknown stage $stage" >&2; return 2 ;;
  esac
}

run_stages "$@"
