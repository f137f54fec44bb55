"""copy_by_kernel: bytes between pinned host memory and the device, moved by a kernel. On the
CPU (the interpreter) both sides are host tensors; the bytes are what counts."""

import numpy as np
import pytest
import torch

from echo_kernels.host_copy import BLOCK_WORDS, copy_by_kernel


@pytest.mark.parametrize("src_dtype, dst_dtype, count, offset", [
    (torch.int64, torch.int64, 3 * BLOCK_WORDS + 5, 0),  # several programs, a ragged last one
    (torch.float32, torch.int32, 7, 0),  # a float's bits, as its integer twin holds them
    (torch.uint8, torch.uint8, 13, 3),  # odd bytes at an odd address: byte words
    (torch.int16, torch.int16, 6, 1),  # 2-byte aligned only
])
def test_copies_every_byte(device, src_dtype, dst_dtype, count, offset):
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (count + offset) * src_dtype.itemsize, dtype=np.uint8)
    src = torch.from_numpy(raw).view(src_dtype)[offset:].to(device)
    # the same size and misalignment as src, filled with a byte the copy must overwrite
    dst = torch.full((len(raw),), 0xAB, dtype=torch.uint8, device=device).view(dst_dtype)[offset:]
    assert copy_by_kernel(dst, src) is dst
    expected = raw[offset * src_dtype.itemsize:].tobytes()
    assert dst.cpu().view(torch.uint8).numpy().tobytes() == expected


def test_refuses_mismatched_or_strided_tensors():
    a = torch.zeros(8, dtype=torch.int32)
    with pytest.raises(ValueError, match="bytes"):
        copy_by_kernel(torch.zeros(7, dtype=torch.int32), a)
    with pytest.raises(ValueError, match="contiguous"):
        copy_by_kernel(torch.zeros(4, dtype=torch.int32), a[::2])


def test_nothing_to_copy_launches_nothing():
    empty = torch.zeros(0, dtype=torch.int64)
    assert copy_by_kernel(empty, empty.clone()) is empty


@pytest.mark.gpu
@pytest.mark.parametrize("to_device", [True, False])
def test_gpu_copy_runs_in_its_stream_and_not_behind_the_copy_engine(to_device):
    """Queued behind a spin on its stream, the copy waits for it (stream order); queued while a
    side stream's large host-to-device copies occupy the copy engine, it finishes before them."""
    values = torch.arange(5000, dtype=torch.int64)
    pinned = values.clone().pin_memory() if to_device else torch.zeros(5000, dtype=torch.int64,
                                                                        pin_memory=True)
    on_device = (torch.zeros(5000, dtype=torch.int64, device="cuda") if to_device
                 else values.cuda())
    dst, src = (on_device, pinned) if to_device else (pinned, on_device)
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)
    copy_by_kernel(dst, src)
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), values)

    dst.zero_()
    big_host = torch.empty(2**30, dtype=torch.uint8, pin_memory=True)
    big_device = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        for _ in range(4):  # ~80 ms at 55 GB/s
            big_device.copy_(big_host, non_blocking=True)
        copies_done = torch.cuda.Event()
        copies_done.record()
    copy_by_kernel(dst, src)
    copied = torch.cuda.Event()
    copied.record()
    copied.synchronize()
    assert not copies_done.query(), "the copy waited for the copy engine's queue"
    assert torch.equal(dst.cpu(), values)
    side.synchronize()
