"""Every environment variable echo reads, typed, in one place (all start with ECHO_).

The kernel package reads one of its own: ECHO_PDL (default 1) launches echo_kernels with
programmatic dependent launch on Hopper and newer (echo_kernels/pdl.py); ECHO_PDL=0 turns it off.
"""

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where converted models and other derived files live (ECHO_CACHE, default ~/.cache/echo)."""
    return Path(os.environ.get("ECHO_CACHE", Path.home() / ".cache" / "echo")).expanduser()


def cpu_kv_cache_gib() -> float:
    """KV-cache size on CPU, where there is no device memory to measure (ECHO_CPU_KV_CACHE_GIB)."""
    return float(os.environ.get("ECHO_CPU_KV_CACHE_GIB", "1"))


def step_timeout_s() -> float:
    """How long the multi-process executor waits for one step's result before it declares a
    worker stuck and stops them all (ECHO_STEP_TIMEOUT_S, default 600). A rank that dies is
    noticed at once; this catches one that hangs while alive, e.g. in a collective."""
    return float(os.environ.get("ECHO_STEP_TIMEOUT_S", "600"))


KV_COPY_MODES = ("staged", "split", "direct")


def kv_early_loads() -> bool:
    """Whether the scheduler joins a small KV host-tier load into blocks no step in flight
    uses: the workers start it at once, beside that step, and its request is admitted in the
    step that carries it, which waits for it on the device (echo/core/kv_cache_manager.py).
    On unless ECHO_KV_EARLY_LOADS=0: on an H100 it brought later turns' TTFT p50 of
    bench_multiturn 5.42x below no tier (docs/benchmarks.md, KV offload, 2026-12-06)."""
    return os.environ.get("ECHO_KV_EARLY_LOADS", "1") == "1"


def kv_joined_load_blocks() -> int | None:
    """With early loads, the most blocks a joined load and the copies queued before it may
    hold (ECHO_KV_JOINED_LOAD_BLOCKS; unset: the KV cache manager's JOINED_LOAD_MAX_BLOCKS), so
    the limit can be timed on a GPU before one is fixed."""
    value = os.environ.get("ECHO_KV_JOINED_LOAD_BLOCKS")
    if value is None:
        return None
    if not value.isdigit():
        raise ValueError(f"ECHO_KV_JOINED_LOAD_BLOCKS must be a whole number of blocks, "
                         f"got {value!r}")
    return int(value)


def kv_copy_mode() -> str:
    """How the KV host tier's copies move blocks (ECHO_KV_COPY_MODE: staged, the default, split
    or direct; echo/worker/kv_transfer.py), so the modes can be timed against each other in the
    engine's own processes before one becomes the default."""
    value = os.environ.get("ECHO_KV_COPY_MODE", "staged")
    if value not in KV_COPY_MODES:
        raise ValueError(f"ECHO_KV_COPY_MODE must be staged, split or direct, got {value!r}")
    return value


STEP_COPY_MODES = ("engine", "kernel")


def step_copy_mode() -> str:
    """How a step's small copies between pinned host memory and the device move
    (ECHO_STEP_COPIES: kernel, the default, by a kernel on the step's stream, which never
    queues behind the KV host tier's copies; or engine, by the copy engine; echo/worker/
    host_copies.py, docs/benchmarks.md KV offload). Read as the engine's buffers are made."""
    value = os.environ.get("ECHO_STEP_COPIES", "kernel")
    if value not in STEP_COPY_MODES:
        raise ValueError(f"ECHO_STEP_COPIES must be engine or kernel, got {value!r}")
    return value


def nvtx_enabled() -> bool:
    """Emit NVTX ranges around engine phases (ECHO_NVTX=1); off costs nothing."""
    return os.environ.get("ECHO_NVTX", "0") == "1"


def log_compiles() -> bool:
    """Print every Triton kernel compilation in the workers (ECHO_LOG_COMPILES=1): a variant
    compiled while serving stalls the step it first appears in (worker/compile_log.py)."""
    return os.environ.get("ECHO_LOG_COMPILES", "0") == "1"


def profile_steps() -> tuple[int, int] | None:
    """Profile the model runner's steps START..START+COUNT-1 (ECHO_PROFILE_STEPS=START:COUNT):
    with the PyTorch profiler when ECHO_PROFILE_OUT is set, else between cudaProfilerStart and
    cudaProfilerStop for an outside profiler (nsys --capture-range=cudaProfilerApi)."""
    value = os.environ.get("ECHO_PROFILE_STEPS", "")
    if not value:
        return None
    start, sep, count = value.partition(":")
    try:
        window = int(start), int(count or "0")
    except ValueError:
        window = (-1, 0)
    if not sep or window[0] < 0 or window[1] < 1:
        raise ValueError(f"ECHO_PROFILE_STEPS must be START:COUNT (START >= 0, COUNT >= 1), "
                         f"got {value!r}")
    return window


def profile_out() -> Path | None:
    """Folder for the PyTorch profiler's Chrome traces (ECHO_PROFILE_OUT); see profile_steps."""
    value = os.environ.get("ECHO_PROFILE_OUT", "")
    return Path(value).expanduser() if value else None


def symm_mem_all_reduce() -> bool:
    """Tensor-parallel all-reduces of small messages on CUDA use a one-shot all-reduce over
    symmetric memory instead of NCCL (ECHO_SYMM_MEM_ALL_REDUCE=1; off: on two GPUs it was
    slower per call than NCCL, docs/benchmarks.md, What was tried and dropped)."""
    return os.environ.get("ECHO_SYMM_MEM_ALL_REDUCE", "0") == "1"


def fused_norm_all_reduce() -> bool:
    """Tensor-parallel all-reduces before an RMSNorm run fused with the residual add and the
    norm, as one-shot writes into peer-mapped inboxes (CUDA; default 1,
    ECHO_FUSED_NORM_ALL_REDUCE=0 turns it off). On two H200s it made a batch-1 Qwen3-8B step
    faster than NCCL (docs/benchmarks.md, Tensor parallelism on two H200s)."""
    return os.environ.get("ECHO_FUSED_NORM_ALL_REDUCE", "1") == "1"


def tune_small_m() -> bool:
    """At start-up, time cuBLAS against echo's GEMV for each linear shape at one row and use
    the faster (ECHO_TUNE_SMALL_M, default 1; 0 keeps cuBLAS everywhere)."""
    return os.environ.get("ECHO_TUNE_SMALL_M", "1") == "1"


def gemv_runs() -> bool:
    """The one-row tuning also times the GEMV tiles over the whole of K (the norm inside or
    not) whose programs take runs of blocks (linear_tuning.RUN_PROGRAMS; ECHO_GEMV_RUNS,
    default 1: Llama-3.1-8B's qkv took them, docs/benchmarks.md, 2026-12-07 late)."""
    return os.environ.get("ECHO_GEMV_RUNS", "1") == "1"


def awq_tensor_cores() -> bool:
    """AWQ layers on a GPU repack their weight at load for the tensor-core kernels
    (echo_kernels/awq_mma.py) instead of AutoAWQ's layout and awq.py's CUDA-core GEMV
    (ECHO_AWQ_MMA, default 1; 0 keeps AutoAWQ's layout, which the persistent decode step
    reads: docs/benchmarks.md, AWQ, has both timed)."""
    return os.environ.get("ECHO_AWQ_MMA", "1") == "1"


def awq_sum_inside() -> bool:
    """The tensor-core AWQ GEMV adds its splits' partial sums in its own launch, the last split
    of a column block to finish doing it, instead of a second launch (ECHO_AWQ_SUM_INSIDE,
    default 1: a Llama-3.1-8B AWQ step 2.681 -> 2.59-2.60 ms on an H100, docs/benchmarks.md)."""
    return os.environ.get("ECHO_AWQ_SUM_INSIDE", "1") == "1"


def api_key() -> str | None:
    """The key `echo serve` requires when --api-key is not given (ECHO_API_KEY)."""
    return os.environ.get("ECHO_API_KEY") or None
