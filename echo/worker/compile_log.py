"""ECHO_LOG_COMPILES=1: print every Triton kernel compilation with what it was specialised for.

A kernel variant first seen while serving compiles inside a step and stalls every stream for a
second or more (kernel_warmup.py exists to prevent that). This log names the variant, so a stall
in a benchmark can be traced to the shape that caused it and added to the warm-up.
"""

import sys
import time

from triton import knobs


def describe_compile(name: str, compile: dict) -> str:
    """`name [warps, stages] CONSTEXPR=value ... | ints divisible by 16: ...` for Triton's
    compile record (its signature, constants keyed by argument path, and attributes)."""
    args = list(compile["signature"])
    consts = " ".join(f"{args[path[0]]}={value}" for path, value in compile["constants"].items()
                      if not args[path[0]].startswith(("stride", "USE_PDL")))
    aligned = [args[path[0]] for path, attr in compile["configs"][0].items()
               if compile["signature"][args[path[0]]][0] != "*" and attr]
    return (f"{name} [warps={compile['num_warps']}, stages={compile['num_stages']}] {consts}"
            f" | ints divisible by 16: {' '.join(aligned) or '-'}")


def log_compiles(label: str) -> None:
    """From now on, print each compilation to stderr with `label` and the seconds since this
    call."""
    start = time.perf_counter()

    def hook(*, fn, compile, **_) -> None:
        print(f"echo: {label} +{time.perf_counter() - start:.1f}s compiled "
              f"{describe_compile(fn.name, compile)}", file=sys.stderr, flush=True)

    knobs.runtime.jit_post_compile_hook = hook
