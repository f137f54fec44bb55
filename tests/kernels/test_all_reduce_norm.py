"""all_reduce_add_rms_norm: the one-shot all-reduce + residual add + RMSNorm kernel.

On CPU (interpreter) two ranks are played one after the other in one process: each rank's
inbox is an ordinary tensor, and what the peer would have sent before a rank's call is written
into that rank's inbox by the test. The result must equal the reference all-reduce followed by
fused_add_rms_norm, bit for bit on both ranks; each call must send this rank's rows to the
peer, -0.0 turned into +0.0, and reset what it read to "not arrived". On a GPU both ranks also
run at the same time, on two streams.
"""

import os
import threading
import time

import pytest
import torch

from echo_kernels.all_reduce_norm import (
    all_reduce_add_rms_norm,
    inbox_dtype,
    inbox_elements,
    not_arrived,
)
from echo_kernels.reference import fused_add_rms_norm_ref

ROWS, HIDDEN, EPS = 3, 48, 1e-6  # a hidden size that is not a power of two: masked columns
PROGRAMS = 2  # fewer than the rows: program 0 owns rows 0 and 2
MAX_ROWS = 4
REGION = MAX_ROWS * HIDDEN  # elements per sender per slot (a multiple of 16)


class Rank:
    def __init__(self, rank: int, world: int, device, dtype=torch.float16):
        self.rank = rank
        self.empty = not_arrived(dtype)
        self.inbox = torch.full((inbox_elements(world, MAX_ROWS, HIDDEN),), self.empty,
                                dtype=inbox_dtype(dtype), device=device)
        self.calls = torch.zeros(PROGRAMS, dtype=torch.int32, device=device)

    def region(self, call: int, sender: int) -> torch.Tensor:
        """Where `sender`'s rows of `call` arrive in this rank's inbox (2 ranks)."""
        start = (call % 2 * 2 + sender) * REGION
        return self.inbox[start:start + ROWS * HIDDEN]


def offsets(tensors, own):
    base, size = own.data_ptr(), own.element_size()
    return torch.tensor([(t.data_ptr() - base) // size for t in tensors], dtype=torch.int64,
                        device=own.device)


def call_kernel(me: Rank, ranks: list[Rank], x, residual, weight, inbox_offsets=None):
    """inbox_offsets: computed here unless given (making them copies to the device, which waits
    for the stream: not while a peer's kernel still has to be launched)."""
    if inbox_offsets is None:
        inbox_offsets = offsets([r.inbox for r in ranks], me.inbox)
    return all_reduce_add_rms_norm(x, residual, weight, EPS, me.rank, me.inbox, inbox_offsets,
                                   me.calls)


def start(me: Rank, ranks: list[Rank], x, residual, weight):
    """One rank's call in a thread; join() returns its result, with a deadline: a protocol
    error would otherwise spin for ever."""
    result = {}
    thread = threading.Thread(
        target=lambda: result.update(out=call_kernel(me, ranks, x, residual, weight)),
        daemon=True)
    thread.start()

    def join():
        thread.join(timeout=120)
        assert not thread.is_alive(), "the kernel is still waiting for its peer's rows"
        return result["out"]

    return thread, join


def sent(x: torch.Tensor) -> torch.Tensor:
    """x's bits as a sender writes them: -0.0 is the "not arrived" mark, so it goes as +0.0."""
    return torch.where(x == 0, torch.zeros_like(x), x).view(inbox_dtype(x.dtype)).view(-1)


def inputs(dtype, device):
    x0, x1, residual = (torch.randn(ROWS, HIDDEN, dtype=dtype, device=device) for _ in range(3))
    x0[0, :2] = -0.0  # one -0.0 meets a +0.0 ...
    x1[0, 1:3] = -0.0  # ... and one meets a -0.0: the sum is -0.0, sent and summed as +0.0
    x1[0, 0] = 0.0
    return x0, x1, residual


def expected(x0, x1, residual, weight):
    reduced = (x0.float() + x1.float()).to(x0.dtype)
    return fused_add_rms_norm_ref(reduced, residual, weight, EPS)


def test_one_rank_is_the_fused_add_rms_norm(device):
    torch.manual_seed(0)
    me = Rank(0, 1, device)
    x, residual = (torch.randn(ROWS, HIDDEN, dtype=torch.float16, device=device)
                   for _ in range(2))
    weight = torch.rand(HIDDEN, dtype=torch.float16, device=device) + 0.5
    expected_out, expected_residual = fused_add_rms_norm_ref(x, residual, weight, EPS)
    out, new_residual = start(me, [me], x, residual.clone(), weight)[1]()
    torch.testing.assert_close(out, expected_out, atol=2e-3, rtol=0)
    assert torch.equal(new_residual, expected_residual)
    assert me.calls.tolist() == [1] * PROGRAMS
    assert torch.all(me.inbox == me.empty)  # nothing sent to itself


def play_two_ranks(device, dtype, atol):
    torch.manual_seed(1)
    r0, r1 = Rank(0, 2, device, dtype), Rank(1, 2, device, dtype)
    ranks = [r0, r1]
    weight = torch.rand(HIDDEN, dtype=dtype, device=device) + 0.5
    for call in (1, 2, 3):  # the slots alternate: 1, 0, 1
        x0, x1, residual = inputs(dtype, device)
        r0.region(call, 1).copy_(sent(x1))  # rank 1 got there first and sent its rows
        out0, res0 = start(r0, ranks, x0, residual.clone(), weight)[1]()
        assert torch.all(r0.region(call, 1) == r0.empty)  # read, then reset
        assert torch.equal(r1.region(call, 0), sent(x0))
        out1, res1 = start(r1, ranks, x1, residual.clone(), weight)[1]()
        assert torch.all(r1.region(call, 0) == r1.empty)
        # rank 1's real send repeats the one the test played: take it back
        assert torch.equal(r0.region(call, 1), sent(x1))
        r0.region(call, 1).fill_(r0.empty)
        assert r0.calls.tolist() == r1.calls.tolist() == [call] * PROGRAMS

        expected_out, expected_residual = expected(x0, x1, residual, weight)
        assert torch.equal(out0, out1) and torch.equal(res0, res1)  # the same bits on each rank
        assert torch.equal(res0, expected_residual)
        torch.testing.assert_close(out0, expected_out, atol=atol, rtol=0)
    for r in ranks:  # every slot is empty again, ready for the next call
        assert torch.all(r.inbox == r.empty)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_two_ranks_sum_in_rank_order_and_reset_the_inbox(device, dtype):
    play_two_ranks(device, dtype, 2e-3)


def test_waits_for_every_element(device):
    torch.manual_seed(2)
    r0, r1 = Rank(0, 2, device), Rank(1, 2, device)
    x0, x1, residual = inputs(torch.float16, device)
    weight = torch.rand(HIDDEN, dtype=torch.float16, device=device) + 0.5
    arriving = sent(x1)
    r0.region(1, 1)[:-1].copy_(arriving[:-1])  # all but the last element of the last row
    thread, join = start(r0, [r0, r1], x0, residual.clone(), weight)
    time.sleep(1.0)
    assert thread.is_alive(), "finished before its peer's last element arrived"
    r0.region(1, 1)[-1:].copy_(arriving[-1:])
    out, new_residual = join()
    expected_out, expected_residual = expected(x0, x1, residual, weight)
    assert torch.equal(new_residual, expected_residual)
    torch.testing.assert_close(out, expected_out, atol=2e-3, rtol=0)


def finish_or_exit(seconds: float) -> None:
    """Wait for the device; a kernel still spinning by then never ends, and would hang every
    later test: end the test process instead."""
    done = torch.cuda.Event()
    done.record()
    deadline = time.monotonic() + seconds
    while not done.query():
        if time.monotonic() > deadline:
            print("all_reduce_add_rms_norm still waiting: ending the test process", flush=True)
            os._exit(1)
        time.sleep(0.01)
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_two_ranks_one_after_the_other_then_at_once(dtype):
    """Both ranks on their own stream, five calls in a row (slots reused): each call must wait
    for the other rank's rows of that call, not an earlier one's."""
    # played first, one rank after the other: that compiles and loads both ranks' kernels
    # (loading a kernel waits for the device, where one rank's kernel would wait for the other)
    play_two_ranks("cuda", dtype, 2e-2)
    torch.manual_seed(3)
    r0, r1 = Rank(0, 2, "cuda", dtype), Rank(1, 2, "cuda", dtype)
    weight = torch.rand(HIDDEN, dtype=dtype, device="cuda") + 0.5
    calls = [inputs(dtype, "cuda") for _ in range(5)]
    residuals = [[c[2].clone() for c in calls] for _ in range(2)]
    outs = [[], []]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    inbox_offsets = [offsets([r0.inbox, r1.inbox], me.inbox) for me in (r0, r1)]
    torch.cuda.synchronize()
    for rank, (me, stream) in enumerate(zip((r0, r1), streams)):
        with torch.cuda.stream(stream):
            for c, res in zip(calls, residuals[rank]):
                outs[rank].append(call_kernel(me, [r0, r1], c[rank], res, weight,
                                              inbox_offsets[rank])[0])
    for stream in streams:
        torch.cuda.current_stream().wait_stream(stream)
    finish_or_exit(seconds=60)
    for i, (x0, x1, residual) in enumerate(calls):
        expected_out, expected_residual = expected(x0, x1, residual, weight)
        assert torch.equal(outs[0][i], outs[1][i])
        assert torch.equal(residuals[0][i], expected_residual)
        torch.testing.assert_close(outs[0][i], expected_out, atol=2e-2, rtol=0)
    assert torch.all(r0.inbox == r0.empty) and torch.all(r1.inbox == r1.empty)


@pytest.mark.parametrize("rows", [MAX_ROWS + 1, 2 * MAX_ROWS])
def test_rejects_more_rows_than_the_inbox_holds(device, rows):
    me = Rank(0, 1, device)
    x = torch.zeros(rows, HIDDEN, dtype=torch.float16, device=device)
    with pytest.raises(AssertionError, match="more rows than the inbox holds"):
        call_kernel(me, [me], x, x.clone(), torch.ones(HIDDEN, dtype=torch.float16,
                                                        device=device))
