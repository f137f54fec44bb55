import pytest
import torch
import triton
import triton.language as tl
from triton import knobs

from echo.worker.compile_log import log_compiles


@triton.jit
def _scale_kernel(x_ptr, n, factor, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * factor, mask=offs < n)


@pytest.mark.gpu
def test_a_compilation_is_logged_with_its_specialisation(capsys):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: the interpreter compiles nothing")
    x = torch.ones(64, device="cuda")
    try:
        log_compiles("rank0")
        _scale_kernel[(1,)](x, 64, 3, BLOCK=64)  # n = 64: divisible by 16
        _scale_kernel[(1,)](x, 64, 3, BLOCK=64)  # cached: no second line
        _scale_kernel[(2,)](x, 50, 3, BLOCK=32)  # a new variant
    finally:
        knobs.runtime.jit_post_compile_hook = None
    torch.cuda.synchronize()
    assert x[:50].tolist() == [27.0] * 50 and x[50:].tolist() == [9.0] * 14
    lines = [line for line in capsys.readouterr().err.splitlines() if "compiled" in line]
    assert len(lines) == 2, lines
    assert lines[0].startswith("echo: rank0 +") and "_scale_kernel" in lines[0]
    assert "BLOCK=64" in lines[0] and "divisible by 16: n" in lines[0]
    assert "BLOCK=32" in lines[1] and "divisible by 16: -" in lines[1]
