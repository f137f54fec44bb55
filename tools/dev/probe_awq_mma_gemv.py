"""An AWQ GEMV for 1-8 rows (more: 8 a program) on the tensor cores, written in Gluon (Triton's
explicit-layout dialect): a probe for #30, against awq_linear at Llama-3.1-8B's layer shapes.

    python tools/dev/probe_awq_mma_gemv.py            # GPU: check, then time (CUDA graphs)
    python tools/dev/probe_awq_mma_gemv.py --sass     # CPU: compile for sm_90, count SASS
    python tools/dev/probe_awq_mma_gemv.py --repack   # CPU: the repacked layout round trip

Why: awq_gemv (CUDA cores, float32 FMAs) runs ~3.4 SASS instructions a weight, and the step
needs its GEMVs near the copy bandwidth for 2.5x bf16. Marlin's way is the tensor core's
m16n8k16 with the weight as operand A straight from registers: a 32-bit register holds two
weights along K, made from two nibbles by one shift and one LOP3 into the mantissa of 1.0
(w' = 1 + q u, u = 2**-7 in bf16, 2**-10 in fp16), and x is operand B, whose 8 columns are up
to 8 rows of x. Triton's tl.dot cannot take A from registers in a layout of our choosing;
Gluon's DotOperandLayout and mma_v2 can. For that the weight is repacked at load: one int32
holds exactly one lane's eight A values of a 16 x 16 tile, and four such int32 (the tile's
four 16-wide K steps of a 64-wide chunk) sit together, one 16-byte load.

Repacked qweight: int32 [N / 16, K / 64, 32, 4], word [nt, kc, lane, j] holding the weights
at n = 16 nt + 8 n3 + lane // 4 and k = 64 kc + 16 j + 8 k3 + 2 (lane % 4) + k0 at nibble
n3 + 2 k3 + 4 k0 (mma_v2's A layout: a lane's register pair is (k0 = 0, 1) of one column, the
four pairs n3, k3 = (0, 0), (1, 0), (0, 1), (1, 1)). Zeros and scales stay AutoAWQ's. Per
group: acc = sum_k w'_k x_k by the tensor cores, and sum_k (q_k - z) x_k = acc / u - (1 / u
+ z) sum_k x_k folded into a float32 total (the GEMV's algebra).
"""

import argparse
import functools
import itertools
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

import torch  # noqa: E402
import triton  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import mma_v2  # noqa: E402

from echo_kernels.reference import awq_unpack_ref  # noqa: E402

_CHUNK = 64  # K a 16-byte load of one lane covers (four 16-wide mma K steps)
SASS_CONFIGS = [(4, 1, 8), (4, 2, 8), (4, 4, 8), (4, 1, 16), (4, 2, 16), (4, 1, 32)]
_MAGIC = {torch.bfloat16: 0x3F803F80, torch.float16: 0x3C003C00}  # 1.0 in both halves


def repack_for_mma(qweight: torch.Tensor, group_size: int) -> torch.Tensor:
    """AutoAWQ qweight int32 [K, N / 8] -> int32 [N / 16, K / 64, 32, 4] (module docstring)."""
    k, n = qweight.shape[0], qweight.shape[1] * 8
    assert group_size % _CHUNK == 0 and k % group_size == 0 and n % 16 == 0
    steps = group_size // 16
    q = awq_unpack_ref(qweight)  # int64 [K, N], column order
    # k = G grp + (G / 4) t + 4 s + 2 h + k0, n = 16 nt + 8 n3 + g: [grp, t, s, h, k0, nt, n3, g]
    q = q.view(k // group_size, 4, steps, 2, 2, n // 16, 2, 8)
    h = torch.arange(2).view(1, 1, 1, 2, 1, 1, 1, 1)
    k0 = torch.arange(2).view(1, 1, 1, 1, 2, 1, 1, 1)
    n3 = torch.arange(2).view(1, 1, 1, 1, 1, 1, 2, 1)
    shifts = (4 * (n3 + 2 * h + 4 * k0)).to(q.device)
    words = (q << shifts).sum(dim=(3, 4, 6))  # [grp, t, s, nt, g]
    words = words.view(k // group_size, 4, steps // 4, 4, n // 16, 8)  # s = 4 sc + j
    words = words.permute(4, 0, 2, 5, 1, 3).reshape(n // 16, k // _CHUNK, 32, 4)
    return (words - (words >= 2**31).long() * 2**32).to(torch.int32).contiguous()


def unpack_repacked(words: torch.Tensor, group_size: int) -> torch.Tensor:
    """repack_for_mma's inverse, int64 [K, N]: the nibble each (k, n) is read from."""
    nt, kc = words.shape[:2]
    groups, steps = kc * _CHUNK // group_size, group_size // 16
    w = words.long().view(nt, groups, steps // 4, 8, 4, 4)  # nt grp sc g t j
    w = w.permute(0, 1, 3, 4, 2, 5).reshape(nt, groups, 8, 4, steps)[..., None, None, None]
    h = torch.arange(2).view(2, 1, 1)
    n3 = torch.arange(2).view(1, 2, 1)
    k0 = torch.arange(2).view(1, 1, 2)
    q = (w >> (4 * (n3 + 2 * h + 4 * k0)).to(w.device)) & 15  # nt grp g t s h n3 k0
    # k = G grp + (G / 4) t + 4 s + 2 h + k0, n = 16 nt + 8 n3 + g
    return q.permute(1, 3, 4, 5, 7, 0, 6, 2).reshape(kc * _CHUNK, nt * 16)


@gluon.jit
def _weight_pair(words, magic, SHIFT: gl.constexpr, BF16: gl.constexpr):
    """[..., 2]: two weights 1 + q u (k0 = 0, 1) from the nibbles at SHIFT and SHIFT + 16, ORed
    into the mantissa of 1.0 in both halves (magic, a register, so that the mask and the OR are
    one LOP3: an instruction holds one immediate). The 32-bit word is the pair as it is: the
    asm takes it twice (pack=2) and returns it, one register of two halves, as mma_v2 wants."""
    return _halves(((words >> SHIFT) & 0x000F000F) | magic, BF16)


@gluon.jit
def _halves(v, BF16: gl.constexpr):
    """int32 [...] -> [..., 2] of its two halves, low first, the register unchanged."""
    if BF16:
        return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r", [gl.join(v, v)],
                                         dtype=gl.bfloat16, is_pure=True, pack=2)
    else:
        return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r", [gl.join(v, v)],
                                         dtype=gl.float16, is_pure=True, pack=2)


@gluon.constexpr_function
def _along(layout, dim):
    """The 1-D layout of dim of a 5-D layout."""
    for d in range(4, -1, -1):
        if d != dim:
            layout = gl.SliceLayout(d, layout)
    return layout


@gluon.constexpr_function
def _x_layout(rows, group, warps):
    """x [rows, 4, group / 8] as int32 pairs: a lane's group / 8 words, then rows 8 apart, in
    its registers; rows mod 8 and the quarter (lane % 4) over lanes, as mma_v2's B layout puts
    N and K; every warp holds all of it."""
    bits = lambda n: [1 << i for i in range(n.bit_length() - 1)]  # noqa: E731
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, b] for b in bits(group // 8)] + [[8 * b, 0, 0] for b in bits(rows // 8)],
        lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[0, 0, 0] for _ in bits(warps)], block_bases=[], shape=[rows, 4, group // 8])


@gluon.jit
def _index(n: gl.constexpr, dim: gl.constexpr, layout: gl.constexpr):
    """arange(n) along dim of a 5-D layout, expanded to 5-D."""
    i = gl.arange(0, n, layout=_along(layout, dim))
    for d in gl.static_range(5):
        if d != dim:
            i = gl.expand_dims(i, d)
    return i


@gluon.jit
def _awq_mma_gemv_kernel(
    x_ptr,  # [M, K] as int32 pairs
    rq_ptr,  # repacked qweight [N / 16, K / 64, 32, 4] int32
    qzeros_ptr,  # [K // G, N // 8] int32, AutoAWQ's
    scales_ptr,  # [K // G, N]
    out_ptr,  # [num_splits, M, N] float32
    M, N, K, n_packed, stride_xm, stride_om, stride_os, groups_per_split,
    magic,  # 1.0 in both halves of an int32: 0x3F803F80 (bf16) or 0x3C003C00 (fp16)
    GROUP: gl.constexpr,  # a multiple of 64
    WARPS: gl.constexpr,
    TILES: gl.constexpr,  # 16-column tiles a warp
    ROWS: gl.constexpr,  # rows of x a program: 8, 16 or 32 (mma_v2's N, 8 a column tile)
    BF16: gl.constexpr,
):
    BM: gl.constexpr = 16 * WARPS * TILES
    KS: gl.constexpr = GROUP // 16  # 16-wide K steps a group
    INV_U: gl.constexpr = 128.0 if BF16 else 1024.0
    DTYPE: gl.constexpr = gl.bfloat16 if BF16 else gl.float16
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1],
                                                  instr_shape=[16, 8])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    # words [tile // WARPS, warp, lane // 4, K step, lane % 4]: a lane's K steps, four of them
    # (one 64-wide chunk) contiguous in memory, then its tiles, in its registers; tile = warp +
    # WARPS * (tile // WARPS), as mma_v2's A layout spreads 16-row tiles over warps
    w_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[TILES, 1, 1, KS, 1],
                                              threads_per_warp=[1, 1, 8, 1, 4],
                                              warps_per_cta=[1, WARPS, 1, 1, 1],
                                              order=[4, 2, 3, 0, 1])
    pid_n = gl.program_id(0)
    split = gl.program_id(1)
    row0 = gl.program_id(2) * ROWS
    rows = M - row0
    kc_count = K // 64
    tile = pid_n * (TILES * WARPS) + _index(TILES, 0, w_layout) * WARPS + _index(WARPS, 1, w_layout)
    ks = _index(KS, 3, w_layout)
    w_offs = (tile.to(gl.int64) * (kc_count * 128) + _index(8, 2, w_layout) * 16
              + (ks // 4) * 128 + ks % 4 + _index(4, 4, w_layout) * 4)
    # x [row, lane % 4, GROUP / 4]: a lane's quarter of a group contiguous (16-byte loads), the
    # quarter being its K in every step (the repacked weight's K order); warps all hold it
    # (x is read as int32 pairs of halves: a loop-carried 16-bit tensor takes 16-bit registers,
    # which ptxas packed, permuted and spilled)
    x_layout: gl.constexpr = _x_layout(ROWS, GROUP, WARPS)
    xm = gl.arange(0, ROWS, layout=gl.SliceLayout(1, gl.SliceLayout(2, x_layout)))
    xt = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, x_layout)))
    xr = gl.arange(0, GROUP // 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, x_layout)))
    xm = gl.expand_dims(gl.expand_dims(xm, 1), 2)
    x_offs = (xm * (stride_xm // 2) + gl.expand_dims(gl.expand_dims(xt, 0), 2) * (GROUP // 8)
              + gl.expand_dims(gl.expand_dims(xr, 0), 1))
    x_mask = xm < rows
    x_ptr += row0 * (stride_xm // 2)
    # sum_k x_k by the tensor cores too: a 16-row tile of ones (rows all equal) times x
    ones = gl.full([16, GROUP], 1.0, DTYPE, a_layout)
    cn = pid_n * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, mma))
    cm = gl.arange(0, ROWS, layout=gl.SliceLayout(0, mma))
    r = cn % 8
    z_shift = (r // 2) * 4 + (r % 2) * 16  # AutoAWQ's nibble of column 8j + r
    first = split * groups_per_split
    end = gl.minimum(first + groups_per_split, K // GROUP)
    total = gl.zeros([BM, ROWS], gl.float32, mma)
    words = gl.load(rq_ptr + w_offs + first * (GROUP * 2))
    xb = gl.load(x_ptr + x_offs + first * (GROUP // 2), mask=x_mask, other=0)
    for group in range(first, end):
        # the next group's weights and x in flight while this one is summed
        nxt = gl.minimum(group + 1, end - 1)
        words_next = gl.load(rq_ptr + w_offs + nxt * (GROUP * 2))
        xb_next = gl.load(x_ptr + x_offs + nxt * (GROUP // 2), mask=x_mask, other=0)
        # pairs (n3, k3) = (0, 0), (1, 0), (0, 1), (1, 1) at nibbles 0, 1, 2, 3 (and 4 up)
        a = gl.join(gl.join(_weight_pair(words, magic, 0, BF16),
                            _weight_pair(words, magic, 4, BF16)),
                    gl.join(_weight_pair(words, magic, 8, BF16),
                            _weight_pair(words, magic, 12, BF16)))
        # [tile // WARPS, warp, g, step, t, k0, n3, k3] -> rows (tile, n3, g), K (step, k3, t, k0)
        a = gl.permute(a, (0, 1, 6, 2, 3, 7, 4, 5))
        a = gl.convert_layout(gl.reshape(a, [BM, GROUP]), a_layout, assert_trivial=True)
        # [row, t, step, h, k0] -> K (step, h, t, k0) by row: mma_v2's B layout, no movement
        b = gl.permute(gl.reshape(_halves(xb, BF16), [ROWS, 4, KS, 2, 2]), (2, 3, 1, 4, 0))
        b = gl.convert_layout(gl.reshape(b, [GROUP, ROWS]), b_layout, assert_trivial=True)
        acc = mma_v2(a, b, gl.zeros([BM, ROWS], gl.float32, mma))
        x_sum = gl.max(mma_v2(ones, b, gl.zeros([16, ROWS], gl.float32, mma)), axis=0)
        s = gl.load(scales_ptr + group * N + cn).to(gl.float32)
        z = ((gl.load(qzeros_ptr + group * n_packed + cn // 8) >> z_shift) & 0xF).to(gl.float32)
        total += gl.expand_dims(s, 1) * (acc * INV_U
                                         - gl.expand_dims(INV_U + z, 1) * gl.expand_dims(x_sum, 0))
        words = words_next
        xb = xb_next
    out = (out_ptr + split.to(gl.int64) * stride_os + (row0 + gl.expand_dims(cm, 0)) * stride_om
           + gl.expand_dims(cn, 1))
    gl.store(out, total, mask=(gl.expand_dims(cm, 0) < rows) & (gl.expand_dims(cn, 1) < N))


def awq_mma_gemv(x: torch.Tensor, rq: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                 group_size: int, warps: int = 4, tiles: int = 1, split_k: int | None = None,
                 per_sm: int = 8, rows: int = 8) -> torch.Tensor:
    """x [M, K] @ W [K, N] from the repacked weight -> [M, N] in x's dtype: a program per
    `rows` rows (8, 16 or 32; each reads its weights again, from the L2 when they run
    together)."""
    import echo_kernels.awq as awq
    from echo_kernels.device import sm_count
    from echo_kernels.pdl import pdl_options
    m, k = x.shape
    n = rq.shape[0] * 16
    assert group_size % 64 == 0 and n % (16 * warps * tiles) == 0
    assert x.stride(1) == 1 and x.stride(0) % 2 == 0 and x.data_ptr() % 16 == 0
    assert x.dtype in (torch.float16, torch.bfloat16)
    groups = k // group_size
    programs = n // (16 * warps * tiles) * triton.cdiv(m, rows)
    if split_k is None:
        split_k = max(1, per_sm * sm_count(x.device, without_gpu=2) // programs)
    per_split = triton.cdiv(groups, min(split_k, groups))
    num_splits = triton.cdiv(groups, per_split)

    def launch(target: torch.Tensor, stride_split: int) -> None:
        _awq_mma_gemv_kernel[(n // (16 * warps * tiles), num_splits, triton.cdiv(m, rows))](
            x.view(torch.int32), rq, qzeros, scales, target, m, n, k, n // 8, x.stride(0), n,
            stride_split,
            per_split, _MAGIC[x.dtype], GROUP=group_size, WARPS=warps, TILES=tiles, ROWS=rows,
            BF16=x.dtype == torch.bfloat16,
            num_warps=warps)

    # the split sum adds float32 partials; one split still writes float32 through it
    if num_splits == 1:
        partial = torch.empty(1, m, n, dtype=torch.float32, device=x.device)
        launch(partial, m * n)
        return partial[0].to(x.dtype)
    return awq._launch_split(launch, num_splits, m, n, x, pdl_options(x.device))


def check_repack() -> None:
    qweight = torch.randint(-2**31, 2**31 - 1, (512, 256 // 8), dtype=torch.int32)
    q = awq_unpack_ref(qweight)
    for group_size in (64, 128, 256):
        back = unpack_repacked(repack_for_mma(qweight, group_size), group_size)
        assert torch.equal(back, q), f"repack round trip differs at G={group_size}"
    print(f"repack round trip: {tuple(q.shape)} equal at G = 64, 128, 256")


def sass() -> None:
    """Compile for sm_90 on this machine and count the loop's instructions."""
    import collections
    import re
    import subprocess

    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    names = ["x_ptr", "rq_ptr", "qzeros_ptr", "scales_ptr", "out_ptr", "M", "N", "K", "n_packed",
             "stride_xm", "stride_om", "stride_os", "groups_per_split", "magic"]
    types = ["*i32", "*i32", "*i32", "*fp16", "*fp32"] + ["i32"] * 9
    bin_dir = Path(triton.__file__).parent / "backends/nvidia/bin"
    for warps, tiles, rows in SASS_CONFIGS:
        sig = dict(zip(names, types)) | {"GROUP": "constexpr", "WARPS": "constexpr",
                                         "TILES": "constexpr", "ROWS": "constexpr",
                                         "BF16": "constexpr"}
        consts = {(14,): 128, (15,): warps, (16,): tiles, (17,): rows, (18,): True}
        attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11)}
        src = GluonASTSource(fn=_awq_mma_gemv_kernel, signature=sig, constexprs=consts,
                             attrs=attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": warps})
        path = Path("/tmp/probe_awq_mma.cubin")
        path.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([bin_dir / "cuobjdump", "-res-usage", path], capture_output=True,
                               text=True).stdout
        regs = re.search(r"REG:(\d+)", usage)
        text = subprocess.run([bin_dir / "cuobjdump", "-sass", path], capture_output=True,
                              text=True).stdout
        lines = re.findall(r"/\*([0-9a-f]{4})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)([^;]*)", text)
        # the loop: from the target of the last backward branch to that branch
        branch = max(i for i, (_, _, op, rest) in enumerate(lines)
                     if op == "BRA" and int(rest.split()[0], 16) < int(lines[i][0], 16))
        start = int(lines[branch][3].split()[0], 16)
        loop = [op.split(".")[0] for addr, _, op, _ in lines[:branch + 1] if int(addr, 16) >= start]
        weights = 16 * 128 * tiles // 32  # a lane's weights a group
        print(f"{warps} warps x {tiles} tiles, {rows} rows: "
              f"{regs.group(1) if regs else '?'} registers, "
              f"loop {len(loop)} instructions, {len(loop) / weights:.2f} a weight; "
              f"{dict(collections.Counter(loop).most_common(12))}")


def time_gpu(rows: list[int], configs: list[tuple[int, int]], per_sm: list[int]) -> None:
    """Each shape and row count (bf16 x): awq_linear, then every (warps, tiles, rows, programs
    an SM) of the probe, in CUDA graphs over weight copies beyond the L2, with the largest error
    of each against the float32 reference relative to its largest value."""
    from bench_kernels import AWQ_GROUP, AWQ_SHAPES, awq_copies, bench_graph

    import echo_kernels.awq as awq
    from echo_kernels.reference import awq_linear_ref

    def error(got: torch.Tensor, ref: torch.Tensor) -> float:
        return ((got.float() - ref).abs().max() / ref.abs().max()).item()

    for name, (n, k) in AWQ_SHAPES.items():
        copies, nbytes = awq_copies(n, k)
        repacked = [(repack_for_mma(qw, AWQ_GROUP), qz, sc) for qw, qz, sc in copies]
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = awq_linear_ref(x.float(), *copies[0], AWQ_GROUP)
            base = bench_graph([functools.partial(awq.awq_linear, x, *c, AWQ_GROUP)
                                for c in copies])
            base_err = error(awq.awq_linear(x, *copies[0], AWQ_GROUP), ref)
            print(f"{name} {n}x{k} M={m} bf16: awq_linear {base * 1e3:.1f} us "
                  f"({nbytes / base / 1e6:.0f} GB/s, err {base_err:.1e})", flush=True)
            for (warps, tiles), rows_a, programs in itertools.product(
                    configs, [8] if m <= 8 else [8, 16, 32], per_sm):
                if n % (16 * warps * tiles) or rows_a > max(m, 8):
                    continue
                gemv = functools.partial(awq_mma_gemv, group_size=AWQ_GROUP, warps=warps,
                                         tiles=tiles, per_sm=programs, rows=rows_a)
                err = error(gemv(x, *repacked[0]), ref)
                ms = bench_graph([functools.partial(gemv, x, *c) for c in repacked])
                print(f"  mma {warps} warps x {tiles} tiles, {rows_a} rows, {programs}/SM: "
                      f"{ms * 1e3:.1f} us ({nbytes / ms / 1e6:.0f} GB/s, err {err:.1e})",
                      flush=True)
        del copies, repacked
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sass", action="store_true", help="compile for sm_90 (no GPU)")
    parser.add_argument("--repack", action="store_true", help="check the repacked layout")
    parser.add_argument("--rows", default="1,2,4,8,16,32,64")
    parser.add_argument("--configs", default="4x1,4x2", help="warps x tiles, ...")
    parser.add_argument("--per-sm", default="4,8", help="programs an SM the splits aim at")
    args = parser.parse_args()
    if args.repack:
        check_repack()
    if args.sass:
        os.environ["TRITON_INTERPRET"] = "0"
        sass()
    if not (args.repack or args.sass):
        configs = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")]
        time_gpu([int(r) for r in args.rows.split(",")], configs,
                 [int(p) for p in args.per_sm.split(",")])


if __name__ == "__main__":
    main()
