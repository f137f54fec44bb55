"""How fast can one launch stream a small model's layer weights through its GEMVs at batch 1?

    python tools/dev/probe_persistent_gemv.py [--layers 28] [--programs-per-sm 1,2]
        [--share-settings 16,4,16,4:4 16,4,32,4:8]

#27's question before a persistent decode kernel is built: Qwen3-0.6B's four GEMVs a layer
(qkv 4096 x 1024, o_proj 1024 x 2048, gate_up 6144 x 1024, down 1024 x 3072; bf16, 881 MB over
28 layers) chained as one row's decode would chain them (each GEMV reads the one before's
output), timed three ways in CUDA graphs:
  launches     small_m_linear once a GEMV (the engine's kernel; PDL as configured)
  persistent   one launch of SMs x programs_per_sm programs that walks every GEMV, a grid
               barrier (an arrival count, acquire/release atomics) between each two
  + prefetch   the same, each program's first weight tile of the next GEMV loaded before the
               barrier (weights do not depend on activations), so the stream does not stop
  no barriers  the persistent kernel without them: its outputs are wrong (no GEMV waits for
               its input), its time is the rate of its weight stream alone
  shares       one launch in which a program owns ROWS contiguous rows of each GEMV over the
               whole of K (its share, 16-64 KB) and requests all of the next GEMV's share
               before it waits at the barrier (before its arrival, or between its arrival and
               its wait): the weights of a phase stream while the stragglers of the one before
               finish, so a phase should cost the barrier and one activation load, not a
               chain of tile latencies (the per-phase ~5 us the persistent decode step showed)
No norms, attention or activation functions: the GEMVs alone, to see what the barriers cost
against the launches. Each variant's output is checked against a PyTorch chain first. The grid
is sized to be co-resident (the barrier would otherwise wait forever); a spin that passes
SPIN_LIMIT polls gives up and the host reports it instead of hanging.
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from bench_kernels import bench_graph, measure_ceilings  # noqa: E402

from echo_kernels.device import sm_count  # noqa: E402
from echo_kernels.linear import small_m_linear, weight_tile  # noqa: E402

# (N, K) of Qwen3-0.6B's GEMVs in layer order; each reads the first K outputs of the one before
SHAPES = ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072))
SPIN_LIMIT = tl.constexpr(1 << 18)
BLOCK_N, BLOCK_K = 8, 512


@triton.jit
def _arrive(arrivals_ptr, ON: tl.constexpr):
    if ON:
        tl.debug_barrier()  # this program's stores before its arrival (released by the atomic)
        tl.atomic_add(arrivals_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _wait(arrivals_ptr, target, error_ptr, ON: tl.constexpr):
    """Poll until `target` programs have arrived; give up after SPIN_LIMIT polls and flag
    error_ptr."""
    if ON:
        polls = 0
        while (tl.atomic_add(arrivals_ptr, 0, sem="acquire", scope="gpu") < target) & (
                polls < SPIN_LIMIT):
            polls += 1
        if polls >= SPIN_LIMIT:
            tl.store(error_ptr, 1)
        tl.debug_barrier()


@triton.jit
def _grid_barrier(arrivals_ptr, target, error_ptr, ON: tl.constexpr):
    """Wait until `target` programs have arrived in total (every program of the grid, once a
    barrier); gives up after SPIN_LIMIT polls and flags error_ptr. ON=False: no barrier."""
    _arrive(arrivals_ptr, ON)
    _wait(arrivals_ptr, target, error_ptr, ON)


@triton.jit
def _gemv_phase(w_ptr, x_ptr, y_ptr, N: tl.constexpr, K: tl.constexpr, w_first,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """This program's row blocks (pid, pid + grid, ...) of y[:N] = W[N, K] @ x[:K]; w_first is
    its first weight tile, loaded already."""
    offs_k = tl.arange(0, BLOCK_K)
    w = w_first
    for block in range(tl.program_id(0), N // BLOCK_N, tl.num_programs(0)):
        rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
        w_ptrs = w_ptr + rows[:, None].to(tl.int64) * K + offs_k[None, :]
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if k0 > 0:
                w = weight_tile(w_ptrs, rows, offs_k, k0, N, K, True)
            # x as a [1, BLOCK_K] row: it takes the weight tile's layout, no shuffle through
            # shared memory
            x = tl.load(x_ptr + k0 + offs_k[None, :], cache_modifier=".cg").to(tl.float32)
            acc += w.to(tl.float32) * x
        tl.store(y_ptr + rows, tl.sum(acc, 1).to(y_ptr.dtype.element_ty))
        next_rows = (block + tl.num_programs(0)) * BLOCK_N + tl.arange(0, BLOCK_N)
        w = weight_tile(w_ptr + next_rows[:, None].to(tl.int64) * K + offs_k[None, :],
                        next_rows, offs_k, 0, N, K, False)


@triton.jit
def _first_tile(w_ptr, N: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    return weight_tile(w_ptr + rows[:, None].to(tl.int64) * K + offs_k[None, :], rows, offs_k,
                       0, N, K, False)


@triton.jit
def _persistent_chain_kernel(
    w_ptr,  # every layer's four weights, one after another
    bufs_ptr,  # [5, 8192]: the input, then each GEMV's output
    arrivals_ptr,  # [2] int32: arrivals at the barriers, programs done; zero on entry and exit
    error_ptr,  # [1] int32
    num_layers,
    N0: tl.constexpr, K0: tl.constexpr, N1: tl.constexpr, K1: tl.constexpr,
    N2: tl.constexpr, K2: tl.constexpr, N3: tl.constexpr, K3: tl.constexpr,
    PREFETCH: tl.constexpr,
    BARRIERS: tl.constexpr,  # False: the GEMVs' stream alone (the outputs are then wrong)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    layer_size = N0 * K0 + N1 * K1 + N2 * K2 + N3 * K3
    grid = tl.num_programs(0)
    w = _first_tile(w_ptr, N0, K0, BLOCK_N, BLOCK_K)
    barriers = 0
    for layer in range(num_layers):
        base = w_ptr + tl.cast(layer, tl.int64) * layer_size
        x_in = bufs_ptr + tl.where(layer == 0, 0, 4) * 8192
        # the GEMVs in turn; after each, the next one's first tile (PREFETCH: before the
        # barrier, so the loads run while programs wait) and the barrier
        _gemv_phase(base, x_in, bufs_ptr + 8192, N0, K0, w, BLOCK_N, BLOCK_K)
        if PREFETCH:
            w = _first_tile(base + N0 * K0, N1, K1, BLOCK_N, BLOCK_K)
        barriers += 1
        _grid_barrier(arrivals_ptr, barriers * grid, error_ptr, BARRIERS)
        if not PREFETCH:
            w = _first_tile(base + N0 * K0, N1, K1, BLOCK_N, BLOCK_K)
        _gemv_phase(base + N0 * K0, bufs_ptr + 8192, bufs_ptr + 2 * 8192, N1, K1, w, BLOCK_N,
                    BLOCK_K)
        if PREFETCH:
            w = _first_tile(base + N0 * K0 + N1 * K1, N2, K2, BLOCK_N, BLOCK_K)
        barriers += 1
        _grid_barrier(arrivals_ptr, barriers * grid, error_ptr, BARRIERS)
        if not PREFETCH:
            w = _first_tile(base + N0 * K0 + N1 * K1, N2, K2, BLOCK_N, BLOCK_K)
        _gemv_phase(base + N0 * K0 + N1 * K1, bufs_ptr + 2 * 8192, bufs_ptr + 3 * 8192, N2, K2,
                    w, BLOCK_N, BLOCK_K)
        if PREFETCH:
            w = _first_tile(base + N0 * K0 + N1 * K1 + N2 * K2, N3, K3, BLOCK_N, BLOCK_K)
        barriers += 1
        _grid_barrier(arrivals_ptr, barriers * grid, error_ptr, BARRIERS)
        if not PREFETCH:
            w = _first_tile(base + N0 * K0 + N1 * K1 + N2 * K2, N3, K3, BLOCK_N, BLOCK_K)
        _gemv_phase(base + N0 * K0 + N1 * K1 + N2 * K2, bufs_ptr + 3 * 8192, bufs_ptr + 4 * 8192,
                    N3, K3, w, BLOCK_N, BLOCK_K)
        next_base = base + layer_size
        if PREFETCH & (layer + 1 < num_layers):
            w = _first_tile(next_base, N0, K0, BLOCK_N, BLOCK_K)
        barriers += 1
        _grid_barrier(arrivals_ptr, barriers * grid, error_ptr, BARRIERS)
        if (not PREFETCH) & (layer + 1 < num_layers):
            w = _first_tile(next_base, N0, K0, BLOCK_N, BLOCK_K)
    # the last program out zeroes the counts for the next launch: every program has passed
    # the last barrier by then, so none reads them again
    if tl.atomic_add(arrivals_ptr + 1, 1, sem="acq_rel", scope="gpu") == grid - 1:
        tl.store(arrivals_ptr, 0)
        tl.store(arrivals_ptr + 1, 0)


# The "shares" variant's settings, "rows a program owns in each GEMV of SHAPES (qkv, o_proj,
# gate_up, down):warps a program"; N / rows programs take part in a phase. 16,4,16,4:4 gives
# 256, 256, 384, 256 programs, 3 an SM, shares of 16-32 KB of bf16 (down's 4 x 3072 rows padded
# to 4 x 4096 in registers: the masked quarter loads nothing); 16,4,32,4:8 gives 2 an SM of 8
# warps, gate_up's share 64 KB. Registers are capped for the programs an SM to fit: sm_90 code
# of the first takes 240 unbounded and 168 capped, without spills (Triton 3.6, offline
# compile, 2026-12-06).
SHARE_SETTINGS = ("16,4,16,4:4", "16,4,32,4:8")


@triton.jit
def _share(w_ptr, n_rows, K: tl.constexpr, ROWS: tl.constexpr):
    """This program's rows of a row-major [n_rows, K] weight, [ROWS, K rounded up to a power
    of two]; zeros for a program past its rows (it takes no part in the phase) and for every
    program when n_rows is 0."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, triton.next_power_of_2(K))
    return tl.load(w_ptr + rows[:, None].to(tl.int64) * K + cols[None, :],
                   mask=(rows[:, None] < n_rows) & (cols[None, :] < K), other=0.0)


@triton.jit
def _share_step(w, x_ptr, y_ptr, next_w_ptr, next_n, arrivals_ptr, target, error_ptr,
                N: tl.constexpr, K: tl.constexpr, ROWS: tl.constexpr, NEXT_K: tl.constexpr,
                NEXT_ROWS: tl.constexpr, LOAD_BEFORE_ARRIVAL: tl.constexpr,
                BARRIERS: tl.constexpr):
    """y[rows] = w @ x[:K] from this program's share w in registers; then the next GEMV's
    share requested (next_n of its rows) and the barrier passed. Returns that share."""
    if tl.program_id(0) * ROWS < N:
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, triton.next_power_of_2(K))
        # x stays in its own dtype until the product: down's 4 x 4096 share would otherwise
        # hold 128 float32 of x a thread beside its weights
        x = tl.load(x_ptr + cols[None, :], mask=cols[None, :] < K, other=0.0,
                    cache_modifier=".cg")
        y = tl.sum(w.to(tl.float32) * x.to(tl.float32), 1)
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty))
    if LOAD_BEFORE_ARRIVAL:
        w = _share(next_w_ptr, next_n, NEXT_K, NEXT_ROWS)
        _arrive(arrivals_ptr, BARRIERS)
    else:
        _arrive(arrivals_ptr, BARRIERS)
        w = _share(next_w_ptr, next_n, NEXT_K, NEXT_ROWS)
    _wait(arrivals_ptr, target, error_ptr, BARRIERS)
    return w


@triton.jit
def _share_chain_kernel(
    w_ptr, bufs_ptr, arrivals_ptr, error_ptr,  # as _persistent_chain_kernel's
    num_layers,
    N0: tl.constexpr, K0: tl.constexpr, N1: tl.constexpr, K1: tl.constexpr,
    N2: tl.constexpr, K2: tl.constexpr, N3: tl.constexpr, K3: tl.constexpr,
    R0: tl.constexpr, R1: tl.constexpr, R2: tl.constexpr, R3: tl.constexpr,
    LOAD_BEFORE_ARRIVAL: tl.constexpr,
    BARRIERS: tl.constexpr,
):
    layer_size = N0 * K0 + N1 * K1 + N2 * K2 + N3 * K3
    grid = tl.num_programs(0)
    o1 = N0 * K0
    o2 = o1 + N1 * K1
    o3 = o2 + N2 * K2
    w = _share(w_ptr, N0, K0, R0)
    target = 0
    for layer in range(num_layers):
        base = w_ptr + tl.cast(layer, tl.int64) * layer_size
        x_in = bufs_ptr + tl.where(layer == 0, 0, 4) * 8192
        target += grid
        w = _share_step(w, x_in, bufs_ptr + 8192, base + o1, N1, arrivals_ptr, target,
                        error_ptr, N0, K0, R0, K1, R1, LOAD_BEFORE_ARRIVAL, BARRIERS)
        target += grid
        w = _share_step(w, bufs_ptr + 8192, bufs_ptr + 2 * 8192, base + o2, N2, arrivals_ptr,
                        target, error_ptr, N1, K1, R1, K2, R2, LOAD_BEFORE_ARRIVAL, BARRIERS)
        target += grid
        w = _share_step(w, bufs_ptr + 2 * 8192, bufs_ptr + 3 * 8192, base + o3, N3,
                        arrivals_ptr, target, error_ptr, N2, K2, R2, K3, R3,
                        LOAD_BEFORE_ARRIVAL, BARRIERS)
        target += grid
        # then the next layer's qkv share: none after the last layer (no rows, so the load
        # past the weights is masked off)
        next_n0 = tl.where(layer + 1 < num_layers, N0, 0)
        w = _share_step(w, bufs_ptr + 3 * 8192, bufs_ptr + 4 * 8192, base + layer_size,
                        next_n0, arrivals_ptr, target, error_ptr, N3, K3, R3, K0, R0,
                        LOAD_BEFORE_ARRIVAL, BARRIERS)
    if tl.atomic_add(arrivals_ptr + 1, 1, sem="acq_rel", scope="gpu") == grid - 1:
        tl.store(arrivals_ptr, 0)
        tl.store(arrivals_ptr + 1, 0)


class PersistentChain:
    """The persistent kernel's buffers, allocated once (so a graph replay is the launch alone)."""

    def __init__(self, weights: torch.Tensor, x: torch.Tensor, num_layers: int, programs: int,
                 prefetch: bool, shapes=SHAPES, barriers: bool = True):
        assert all(n <= 8192 and k <= 8192 for n, k in shapes)
        self.weights, self.num_layers, self.programs, self.prefetch = (weights, num_layers,
                                                                       programs, prefetch)
        self.shapes, self.barriers = shapes, barriers
        self.bufs = torch.zeros(5, 8192, dtype=x.dtype, device=x.device)
        self.bufs[0, :x.numel()] = x
        self.arrivals = torch.zeros(2, dtype=torch.int32, device=x.device)
        self.error = torch.zeros(1, dtype=torch.int32, device=x.device)

    def __call__(self) -> torch.Tensor:
        """The last GEMV's output [N3]."""
        (n0, k0), (n1, k1), (n2, k2), (n3, k3) = self.shapes
        _persistent_chain_kernel[(self.programs,)](
            self.weights, self.bufs, self.arrivals, self.error, self.num_layers, N0=n0, K0=k0,
            N1=n1, K1=k1, N2=n2, K2=k2, N3=n3, K3=k3, PREFETCH=self.prefetch,
            BARRIERS=self.barriers, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4)
        return self.bufs[4, :n3]


class ShareChain(PersistentChain):
    """The "shares" variant: as many programs as the largest phase has shares (they must be
    co-resident: at most 3 an SM at 4 warps). rows: a program's rows in each GEMV, powers of
    two dividing N."""

    def __init__(self, weights: torch.Tensor, x: torch.Tensor, num_layers: int,
                 load_before_arrival: bool, barriers: bool = True, shapes=SHAPES, *,
                 rows: tuple[int, ...], warps: int = 4):
        assert all(n % r == 0 for (n, _), r in zip(shapes, rows))
        programs = max(n // r for (n, _), r in zip(shapes, rows))
        super().__init__(weights, x, num_layers, programs, False, shapes, barriers)
        self.rows, self.load_before_arrival, self.warps = rows, load_before_arrival, warps
        # an SM's 64K registers shared by the programs it must hold at once
        per_sm = triton.cdiv(programs, sm_count(x.device, without_gpu=2))
        self.max_registers = min(255, 65536 // (per_sm * warps * 32) // 8 * 8)

    def __call__(self) -> torch.Tensor:
        (n0, k0), (n1, k1), (n2, k2), (n3, k3) = self.shapes
        r0, r1, r2, r3 = self.rows
        _share_chain_kernel[(self.programs,)](
            self.weights, self.bufs, self.arrivals, self.error, self.num_layers, N0=n0, K0=k0,
            N1=n1, K1=k1, N2=n2, K2=k2, N3=n3, K3=k3, R0=r0, R1=r1, R2=r2, R3=r3,
            LOAD_BEFORE_ARRIVAL=self.load_before_arrival, BARRIERS=self.barriers,
            num_warps=self.warps, maxnreg=self.max_registers)
        return self.bufs[4, :n3]


def layer_views(weights: torch.Tensor, num_layers: int,
                shapes=SHAPES) -> list[list[torch.Tensor]]:
    """Each layer's four [N, K] weights as views of the one buffer."""
    views, offset = [], 0
    for _ in range(num_layers):
        layer = []
        for n, k in shapes:
            layer.append(weights[offset:offset + n * k].view(n, k))
            offset += n * k
        views.append(layer)
    return views


def chain(x: torch.Tensor, views, matmul) -> torch.Tensor:
    """The chain with `matmul(x [1, K], w [N, K]) -> [1, N]` a GEMV."""
    y = x.view(1, -1)
    for layer in views:
        for w in layer:
            y = matmul(y[:, :w.shape[1]].contiguous(), w)
    return y.view(-1)


def reference(x: torch.Tensor, views) -> torch.Tensor:
    """float32 products, each output rounded to x's dtype as the kernels store it."""
    return chain(x, views, lambda y, w: (y.float() @ w.float().T).to(x.dtype))


def graph_us(fn) -> float:
    """Median µs of fn replayed from a CUDA graph (bench_kernels' bench_graph, once a replay)."""
    return bench_graph([fn], inner=1) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--programs-per-sm", default="1,2")
    parser.add_argument("--share-settings", nargs="*", default=list(SHARE_SETTINGS),
                        help="the shares variant's ROWS,ROWS,ROWS,ROWS:WARPS settings")
    args = parser.parse_args()
    torch.manual_seed(0)
    per_layer = sum(n * k for n, k in SHAPES)
    weights = torch.randn(args.layers * per_layer, device="cuda", dtype=torch.bfloat16) / 32
    views = layer_views(weights, args.layers)
    x = torch.randn(SHAPES[0][1], device="cuda", dtype=torch.bfloat16)
    want = reference(x, views).float()
    nbytes = weights.numel() * 2
    copy_tbs = measure_ceilings()["copy_TBps"]
    print(f"{args.layers} layers, {nbytes / 1e6:.0f} MB of weights; copy bandwidth "
          f"{copy_tbs:.2f} TB/s: {nbytes / copy_tbs / 1e6:.1f} us at it", flush=True)

    def report(name, fn, error=None):
        got = fn().float()
        if error is not None and error.item():
            print(f"{name}: a barrier gave up waiting (the grid was not co-resident)", flush=True)
            return
        err = ((got - want).abs().max() / want.abs().max()).item()
        us = graph_us(fn)
        print(f"{name:<34} {us:8.1f} us  {nbytes / us / 1e6:5.2f} TB/s  "
              f"{us / (4 * args.layers):5.2f} us a GEMV  max error {err:.2e}", flush=True)

    report("launches (small_m_linear)", lambda: chain(x, views, small_m_linear))
    sms = sm_count(x.device, without_gpu=2)
    for per_sm in map(int, args.programs_per_sm.split(",")):
        for prefetch in (False, True):
            run = PersistentChain(weights, x, args.layers, sms * per_sm, prefetch)
            report(f"persistent {per_sm}/SM{' + prefetch' if prefetch else ''}", run, run.error)
        run = PersistentChain(weights, x, args.layers, sms * per_sm, True, barriers=False)
        report(f"no barriers {per_sm}/SM (rate only)", run)
    for setting in args.share_settings:
        rows, warps = setting.split(":")
        rows, warps = tuple(map(int, rows.split(","))), int(warps)
        for before in (True, False, None):  # None: no barriers (its rate only)
            run = ShareChain(weights, x, args.layers, bool(before), before is not None, rows=rows,
                             warps=warps)
            when = {True: "loads before the arrival", False: "loads after the arrival",
                    None: "no barriers (rate only)"}[before]
            report(f"shares {setting} ({run.programs} programs, {run.max_registers} registers), "
                   f"{when}", run, run.error)


if __name__ == "__main__":
    main()
