"""all_reduce_add_rms_norm: the one-shot all-reduce + residual add + RMSNorm kernel.

On CPU (interpreter) two ranks are played one after the other in one process: each rank's
buffer and signal pad are ordinary tensors, and what the peer would have done before a rank's
call (its copy into the call's half of its buffer, its announcement) is written by the test.
The result must equal the reference all-reduce followed by fused_add_rms_norm, bit for bit on
both ranks, and the signal pads must hold the calls the protocol promises.
"""

import threading

import pytest
import torch

from echo_kernels.all_reduce_norm import all_reduce_add_rms_norm
from echo_kernels.reference import fused_add_rms_norm_ref

ROWS, HIDDEN, EPS = 3, 48, 1e-6  # a hidden size that is not a power of two: masked columns
PROGRAMS = 2  # fewer than the rows: program 0 owns rows 0 and 2
HALF = 4 * HIDDEN  # elements per half of a buffer: 4 rows


class Rank:
    def __init__(self, rank: int, device, dtype=torch.float16):
        self.rank = rank
        self.buffer = torch.zeros(2 * HALF, dtype=dtype, device=device)
        self.signals = torch.zeros(PROGRAMS * 2, dtype=torch.int32, device=device)
        self.calls = torch.zeros(PROGRAMS, dtype=torch.int32, device=device)


def offsets(tensors, own):
    base, size = own.data_ptr(), own.element_size()
    return torch.tensor([(t.data_ptr() - base) // size for t in tensors], dtype=torch.int64,
                        device=own.device)


def run(me: Rank, ranks: list[Rank], x, residual, weight):
    """One rank's call, with a deadline: a protocol error would otherwise spin for ever."""
    result = {}

    def call():
        result["out"] = all_reduce_add_rms_norm(
            x, residual, weight, EPS, me.rank, me.buffer,
            offsets([r.buffer for r in ranks], me.buffer), me.signals,
            offsets([r.signals for r in ranks], me.signals), me.calls)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive(), "the kernel is still waiting at a barrier"
    return result["out"]


def pad(r: Rank, pid: int, peer: int) -> int:
    """The last call `peer` announced to rank r for program `pid`."""
    return int(r.signals[pid * 2 + peer])


def test_one_rank_is_the_fused_add_rms_norm(device):
    torch.manual_seed(0)
    me = Rank(0, device)
    x, residual = (torch.randn(ROWS, HIDDEN, dtype=torch.float16, device=device)
                   for _ in range(2))
    weight = torch.rand(HIDDEN, dtype=torch.float16, device=device) + 0.5
    expected_out, expected_residual = fused_add_rms_norm_ref(x, residual, weight, EPS)
    out, new_residual = run(me, [me], x, residual.clone(), weight)
    torch.testing.assert_close(out, expected_out, atol=2e-3, rtol=0)
    assert torch.equal(new_residual, expected_residual)
    assert me.calls.tolist() == [1] * PROGRAMS


def play_two_ranks(device, dtype, atol):
    torch.manual_seed(1)
    r0, r1 = Rank(0, device, dtype), Rank(1, device, dtype)
    ranks = [r0, r1]
    weight = torch.rand(HIDDEN, dtype=dtype, device=device) + 0.5
    for call in (1, 2, 3):  # the halves alternate: 1, 0, 1
        x0, x1, residual = (torch.randn(ROWS, HIDDEN, dtype=dtype, device=device)
                            for _ in range(3))
        half = slice(call % 2 * HALF, call % 2 * HALF + ROWS * HIDDEN)
        # rank 1 got there first: its copy is in its buffer and it announced the call
        r1.buffer[half] = x1.view(-1)
        for pid in range(PROGRAMS):
            r0.signals[pid * 2 + 1] = call
        out0, res0 = run(r0, ranks, x0, residual.clone(), weight)
        assert torch.equal(r0.buffer[half], x0.view(-1))
        assert [pad(r1, pid, 0) for pid in range(PROGRAMS)] == [call] * PROGRAMS
        out1, res1 = run(r1, ranks, x1, residual.clone(), weight)
        assert [pad(r0, pid, 1) for pid in range(PROGRAMS)] == [call] * PROGRAMS
        assert r0.calls.tolist() == r1.calls.tolist() == [call] * PROGRAMS

        reduced = (x0.float() + x1.float()).to(dtype)
        expected_out, expected_residual = fused_add_rms_norm_ref(reduced, residual, weight, EPS)
        assert torch.equal(out0, out1) and torch.equal(res0, res1)  # the same bits on each rank
        assert torch.equal(res0, expected_residual)
        torch.testing.assert_close(out0, expected_out, atol=atol, rtol=0)


def test_two_ranks_sum_in_rank_order_and_keep_the_phases(device):
    play_two_ranks(device, torch.float16, 2e-3)


@pytest.mark.gpu
def test_gpu_two_ranks_played_on_one_device():
    # the real atomics, acquire loads and vector loads of peer memory, on one GPU
    play_two_ranks("cuda", torch.bfloat16, 2e-2)


@pytest.mark.parametrize("rows", [HALF // HIDDEN + 1, 2 * HALF // HIDDEN])
def test_rejects_more_rows_than_half_the_buffer_holds(device, rows):
    me = Rank(0, device)
    x = torch.zeros(rows, HIDDEN, dtype=torch.float16, device=device)
    with pytest.raises(AssertionError):
        all_reduce_add_rms_norm(x, x.clone(), torch.ones(HIDDEN, dtype=torch.float16,
                                                         device=device), EPS, 0, me.buffer,
                                offsets([me.buffer], me.buffer), me.signals,
                                offsets([me.signals], me.signals), me.calls)
