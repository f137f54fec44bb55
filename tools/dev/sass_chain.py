"""How many memory round trips stand one after another in a Triton kernel's program, read from
its sm_90 SASS, compiled on a machine without a GPU.

    python tools/dev/sass_chain.py paged-decode [--model qwen3-0.6b] [--sass FILE]

At batch 1 most of echo's kernels move a few kilobytes a program, so a program's time is its
chain of dependent loads (each ~0.5-1 us from L2 or HBM) and, in a one-warp program, the
instructions it issues one after another, not bandwidth. This compiles the kernel for sm_90
(Triton's ptxas, no driver needed), then walks the SASS once in program order: an
instruction's depth is the largest depth among the registers it reads, plus one for a load
from global memory (LDG, LD, ATOMG, and LDGSTS, whose copy the next DEPBAR hands to the
ldmatrix loads after it; values exchanged through STS and LDS keep their depth, told apart by
the immediate offset). Branches are taken as straight-line code and a loop once, which is what
a decode program that visits one key tile runs. It prints the registers, the spills, the
instruction count and the longest chain of global round trips (with --loads, every global load
and store with its depth).

`compile_sm90` takes any triton.jit kernel and its arguments as they would be passed (CPU
tensors stand for device ones: only their dtypes count), so other kernels can be read the same
way from a Python prompt.
"""

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

os.environ["TRITON_INTERPRET"] = "0"  # the JIT function itself, not the interpreter's wrapper
ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

import torch  # noqa: E402
import triton  # noqa: E402

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
           torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64",
           torch.uint8: "u8"}
# loads whose result waits for a global memory round trip
_GLOBAL_LOADS = ("LDG", "LD", "ATOMG", "ATOM")
_NO_DEST = ("ST", "STG", "STS", "STL", "RED", "BAR", "BRA", "EXIT", "LDGSTS", "DEPBAR", "MEMBAR",
            "CCTL", "NOP", "WARPSYNC", "BSYNC", "BSSY", "CALL", "RET", "YIELD", "ERRBAR")


def compile_sm90(fn, args: dict, num_warps: int = 4, num_stages: int = 3,
                 maxnreg: int | None = None) -> bytes:
    """The cubin of triton.jit `fn` for sm_90 with these arguments (every parameter by name;
    constexprs by value), specialised as Triton's launcher would: 16-byte aligned pointers,
    ints divisible by 16 marked so and ints equal to 1 folded, unless do_not_specialize."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(fn.params):
        value = args[param.name]
        if param.is_constexpr or value is None:
            signature[param.name] = "constexpr"
            constexprs[(i,)] = value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + _DTYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int):
            if value == 1 and not param.do_not_specialize:
                signature[param.name] = "constexpr"
                constexprs[(i,)] = 1
                continue
            signature[param.name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if value % 16 == 0 and not param.do_not_specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        else:
            raise TypeError(f"{param.name}: {type(value).__name__} is not a kernel argument")
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["cubin"]


def cuobjdump(cubin: bytes, flag: str) -> str:
    """cuobjdump's output (-sass, -res-usage) for a cubin, with Triton's own binary."""
    path = Path("/tmp/sass_chain.cubin")
    path.write_bytes(cubin)
    tool = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    return subprocess.run([tool, flag, path], capture_output=True, text=True, check=True).stdout


def resources(cubin: bytes) -> tuple[int, int]:
    """(registers a thread, bytes of stack: spills) of a cubin."""
    usage = cuobjdump(cubin, "-res-usage")
    return (int(re.search(r"REG:(\d+)", usage).group(1)),
            int(re.search(r"STACK:(\d+)", usage).group(1)))


def preset_attention(model: str) -> tuple[int, int, int, bool]:
    """(heads, KV heads, head_dim, Qwen3's q/k norm) of a preset, as the engine reads it."""
    from echo.models.arch import PRESETS_DIR, arch_from_hf_config, read_config_json

    arch = arch_from_hf_config(read_config_json(PRESETS_DIR / f"{model}.json"))
    return arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.family.startswith("qwen3")


def _registers(operand: str) -> list[str]:
    """The general (R), uniform (UR) and predicate (P, UP) registers an operand names, a
    .64 pair as both halves."""
    names = []
    for kind, num, wide in re.findall(r"\b(R|UR|P|UP)(\d+)(\.64)?", operand):
        names.append(f"{kind}{num}")
        if wide:
            names.append(f"{kind}{int(num) + 1}")
    return names


def _width(op: str) -> int:
    """Registers an instruction's destination spans."""
    if ".128" in op or op.startswith("HMMA") or op.startswith("LDSM.16.M88.4"):
        return 4
    if ".64" in op or op.startswith("IMAD.WIDE") or op.startswith("LDSM.16.M88.2"):
        return 2
    return 1


class Step(NamedTuple):
    addr: str
    op: str
    operands: str
    depth: int  # global round trips before its result is there
    last_load: int | None  # the last global load on its longest chain (an index into steps)
    prev_load: int | None  # a load's: the last load on the chain to its address


def _region(operands: str) -> int:
    """The 256-byte region of shared memory an STS or LDS names by its immediate offset
    (Triton gives each exchange buffer its own offset)."""
    offset = re.search(r"\[[^\]]*?\+(?:UR\d+\+)?0x([0-9a-f]+)\]", operands)
    return int(offset.group(1), 16) >> 8 if offset else 0


def chain(sass: str) -> list[Step]:
    """Every instruction of the SASS in program order with its depth (module docstring)."""
    produced: dict[str, tuple[int, int | None]] = {}  # register -> (depth, last load)
    # shared memory as two things: the cp.async (LDGSTS) copies that a DEPBAR waits for and
    # ldmatrix (LDSM) reads, and the values threads exchange through STS and LDS, by region
    copies = ready = (0, None)
    exchanged: dict[int, tuple[int, int | None]] = {}
    steps: list[Step] = []
    for addr, guard, op, rest in re.findall(
            r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)([^;]*);", sass):
        operands = [o.strip() for o in rest.split(",")] if rest.strip() else []
        if operands[:1] == ["PT"]:  # SHFL's unused predicate result: its register comes next
            operands = operands[1:]
        base = op.split(".")[0]
        has_dest = base not in _NO_DEST and operands and re.match(r"(U?R|U?P)\d+", operands[0])
        sources = operands[1:] if has_dest else operands
        depth, last = max([produced.get(r, (0, None)) for s in sources + [guard]
                           for r in _registers(s)], default=(0, None), key=lambda d: d[0])
        prev = None
        if base in _GLOBAL_LOADS or base == "LDGSTS":
            depth, last, prev = depth + 1, len(steps), last
        if base == "LDSM" and ready[0] > depth:
            depth, last = ready
        elif base == "LDS" and exchanged.get(_region(rest), (0,))[0] > depth:
            depth, last = exchanged[_region(rest)]
        elif base == "LDGSTS" and depth > copies[0]:
            copies = (depth, last)
        elif base == "DEPBAR" and copies[0] > ready[0]:
            ready = copies
        elif base == "STS" and depth > exchanged.get(_region(rest), (0,))[0]:
            exchanged[_region(rest)] = (depth, last)
        if has_dest:
            kind, num = re.match(r"([A-Z]+)(\d+)", _registers(operands[0])[0]).groups()
            for i in range(_width(op)):
                produced[f"{kind}{int(num) + i}"] = (depth, last)
        steps.append(Step(addr, op, rest.strip(), depth, last, prev))
    return steps


def critical_path(steps: list[Step]) -> list[Step]:
    """The global loads the deepest instruction waits for, one after another, first first."""
    deepest = max(steps, key=lambda s: s.depth)
    path, i = [deepest], deepest.last_load
    while i is not None:
        path.append(steps[i])
        i = steps[i].prev_load
    return path[::-1]


def report(cubin: bytes, sass_file: Path | None = None, loads: bool = False) -> None:
    """Registers, spills and the longest chain of global round trips; loads: every global load
    with its depth."""
    regs, stack = resources(cubin)
    sass = cuobjdump(cubin, "-sass")
    if sass_file:
        sass_file.write_text(sass)
    steps = chain(sass)
    print(f"{regs} registers, {stack} bytes of stack, {len(steps)} instructions")
    if loads:
        for step in steps:
            if step.op.split(".")[0] in _GLOBAL_LOADS + ("LDGSTS", "STG", "BAR"):
                print(f"  {step.addr} {step.op:<24} depth {step.depth}  {step.operands[:50]}")
    path = critical_path(steps)
    print(f"the longest chain, {path[-1].depth} global round trips, ends at {path[-1].op} "
          f"{path[-1].addr}:")
    for step in path:
        print(f"  {step.addr} {step.op:<24} depth {step.depth}  {step.operands[:60]}")


def paged_decode_args(model: str) -> tuple[object, dict, dict]:
    """_paged_attention_kernel as a batch-1 decode step launches it (fused RoPE and K/V store,
    the keys split), at a preset's attention shapes."""
    from echo_kernels.attention.common import tile_config
    from echo_kernels.attention.paged import _paged_attention_kernel

    heads, kv_heads, head_dim, qk_norm = preset_attention(model)
    group, block_size = heads // kv_heads, 16
    tiles = tile_config(group, head_dim)
    bf16, f32, i32 = (torch.empty(1, dtype=t) for t in (torch.bfloat16, torch.float32,
                                                        torch.int32))
    cache_stride = (block_size * kv_heads * head_dim, kv_heads * head_dim, head_dim)
    qkv_stride = (heads + 2 * kv_heads) * head_dim
    args = dict(
        q_ptr=bf16, k_cache_ptr=bf16, v_cache_ptr=bf16, k_scale_ptr=f32, v_scale_ptr=f32,
        block_table_ptr=i32, cu_seqlens_q_ptr=i32, seq_lens_ptr=i32, seq_order_ptr=i32,
        out_ptr=bf16, part_acc_ptr=f32, part_ml_ptr=f32, num_seqs=1, num_heads=heads,
        num_splits=8, qk_scale=0.1, stride_qt=qkv_stride, stride_qh=head_dim,
        stride_ot=heads * head_dim, stride_oh=head_dim, stride_kb=cache_stride[0],
        stride_kt=cache_stride[1], stride_kh=cache_stride[2], stride_sb=block_size * kv_heads,
        stride_st=kv_heads, stride_sh=1, stride_bt=128, block_base=0, k_new_ptr=bf16,
        v_new_ptr=bf16, positions_ptr=torch.empty(1, dtype=torch.int64), cos_sin_ptr=f32,
        q_norm_ptr=bf16, k_norm_ptr=bf16, slot_mapping_ptr=torch.empty(1, dtype=torch.int64),
        stride_nkt=qkv_stride, stride_nkh=head_dim, stride_nvt=qkv_stride, stride_nvh=head_dim,
        stride_cos=head_dim, rope_eps=1e-6, GROUP=group, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        ONE_TILE_PER_SEQ=True, ORDERED=False, SPLIT=True, IS_INT8_KV=False, WIDE_OFFSETS=False,
        FUSED_ROPE=True, IS_NEOX=True, HAS_NORM=qk_norm, USE_PDL=True)
    return _paged_attention_kernel, args, tiles.launch_options()


KERNELS = {"paged-decode": paged_decode_args}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kernel", choices=sorted(KERNELS))
    parser.add_argument("--model", default="qwen3-0.6b", help="a preset's shapes")
    parser.add_argument("--sass", type=Path, help="also write the whole SASS here")
    parser.add_argument("--loads", action="store_true", help="list every global load")
    args = parser.parse_args()
    fn, kernel_args, options = KERNELS[args.kernel](args.model)
    report(compile_sm90(fn, kernel_args, **options), args.sass, args.loads)


if __name__ == "__main__":
    main()
