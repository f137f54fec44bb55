"""Every environment variable echo reads, typed, in one place (all start with ECHO_)."""

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where converted models and other derived files live (ECHO_CACHE, default ~/.cache/echo)."""
    return Path(os.environ.get("ECHO_CACHE", Path.home() / ".cache" / "echo")).expanduser()


def cpu_kv_cache_gib() -> float:
    """KV-cache size on CPU, where there is no device memory to measure (ECHO_CPU_KV_CACHE_GIB)."""
    return float(os.environ.get("ECHO_CPU_KV_CACHE_GIB", "1"))


def nvtx_enabled() -> bool:
    """Emit NVTX ranges around engine phases (ECHO_NVTX=1); off costs nothing."""
    return os.environ.get("ECHO_NVTX", "0") == "1"
