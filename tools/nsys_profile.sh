#!/usr/bin/env bash
# Profile any echo command over a window of engine steps, then report how much CPU work hid
# behind GPU work (tools/overlap_report.py).
#
#   tools/nsys_profile.sh [--out DIR] [--steps START:COUNT] [--profiler auto|nsys|torch] \
#       -- <command...>
#
# e.g. tools/nsys_profile.sh --out /tmp/prof -- python tools/bench_offline.py
#
# nsys (when `nsys --version` works): Nsight Systems traces cuda, nvtx and osrt, capturing only
#   between the engine's cudaProfilerStart/Stop (steps START..START+COUNT-1), follows every
#   process (core, workers), and is exported to DIR/echo.sqlite.
# torch (otherwise; the H200 machine has no working nsys): the PyTorch profiler (CUPTI kernels
#   plus the same echo.* ranges) runs inside the process that owns the ModelRunner and writes
#   DIR/echo_trace_rank<r>.json.gz. With the multi-process engine that is the worker: the
#   core's ranges (schedule, update) are then not in the trace.
# Both set ECHO_NVTX=1 and ECHO_PROFILE_STEPS (echo/envs.py). The command runs in its own
# process group, which is ended (SIGINT, then SIGTERM, then SIGKILL) on exit or interruption.
# Ctrl-C ends the command and still reports: the way to stop a profiled server.
set -euo pipefail

usage() { sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; }

here=$(cd "$(dirname "$0")" && pwd)
out="profile-$(date +%Y%m%d-%H%M%S)"
steps="200:40"  # bench_offline: past prefill, in steady decode with a full batch
profiler="${ECHO_PROFILER:-auto}"
python="${PYTHON:-python3}"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out) out=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --profiler) profiler=$2; shift 2 ;;
    --) shift; break ;;
    -h|--help) usage; exit 0 ;;
    *) echo "nsys_profile.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
  esac
done
if [[ $# -eq 0 ]]; then usage >&2; exit 2; fi
if [[ ! $steps =~ ^[0-9]+:[1-9][0-9]*$ ]]; then
  echo "nsys_profile.sh: --steps must be START:COUNT, got $steps" >&2; exit 2
fi
mkdir -p "$out"
out=$(cd "$out" && pwd)

group=""  # process group of the profiled command (its leader's pid)

group_alive() { [[ -n $group ]] && kill -0 -- "-$group" 2>/dev/null; }

end_group() {
  # SIGINT first, with time to spare: Python unwinds and its atexit hooks still write a window
  # cut short (a large trace takes seconds); then SIGTERM, then SIGKILL
  local sig tenths
  for sig in INT:300 TERM:50 KILL:0; do
    group_alive || return 0
    kill -"${sig%%:*}" -- "-$group" 2>/dev/null || true
    for ((tenths = ${sig##*:}; tenths > 0; tenths--)); do
      group_alive || return 0
      sleep 0.1
    done
  done
}
trap end_group EXIT
# Ctrl-C stops the command (a server, say) and still reports on the trace; SIGTERM stops all
trap end_group INT
trap 'end_group; exit 143' TERM

# a background job of a script starts with SIGINT ignored, and Python then never raises
# KeyboardInterrupt: restore the default before exec'ing the command
default_sigint=("$python" -c 'import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_DFL)
os.execvp(sys.argv[1], sys.argv[1:])')

run_group() {  # run "$@" as a new process group; wait for it; return its status
  if command -v setsid >/dev/null; then
    setsid "${default_sigint[@]}" "$@" &
  else
    "${default_sigint[@]}" "$@" &
  fi
  group=$!
  local rc=0
  wait "$group" || rc=$?
  end_group  # anything it left behind
  return "$rc"
}

if [[ $profiler == auto ]]; then
  if command -v nsys >/dev/null 2>&1 && nsys --version >/dev/null 2>&1; then
    profiler=nsys
  else
    profiler=torch
  fi
fi

export ECHO_NVTX=1 ECHO_PROFILE_STEPS="$steps"
rc=0
case "$profiler" in
  nsys)
    unset ECHO_PROFILE_OUT  # the engine then calls cudaProfilerStart/Stop around the window
    rm -f "$out/echo.nsys-rep" "$out/echo.qdrep" "$out/echo.sqlite"
    run_group nsys profile -t cuda,nvtx,osrt --capture-range=cudaProfilerApi \
      --capture-range-end=stop --cuda-graph-trace=node --force-overwrite=true \
      -o "$out/echo" "$@" || rc=$?
    report="$out/echo.nsys-rep"
    [[ -f $report ]] || report="$out/echo.qdrep"  # older nsys
    if [[ -f $report ]]; then
      nsys export --type sqlite --force-overwrite=true -o "$out/echo.sqlite" "$report"
    fi
    trace="$out/echo.sqlite"
    ;;
  torch)
    rm -f "$out"/echo_trace_rank*.json.gz
    ECHO_PROFILE_OUT="$out" run_group "$@" || rc=$?
    trace="$out/echo_trace_rank0.json.gz"
    ;;
  *) echo "nsys_profile.sh: --profiler must be auto, nsys or torch" >&2; exit 2 ;;
esac

if [[ $rc -ne 0 ]]; then
  echo "nsys_profile.sh: the command exited with status $rc" >&2
fi
if [[ ! -f $trace ]]; then
  echo "nsys_profile.sh: no trace at $trace (did the run reach step ${steps%%:*}? see --steps)" >&2
  exit $(( rc ? rc : 1 ))
fi
"$python" "$here/overlap_report.py" "$trace" --out "$out"
exit "$rc"
