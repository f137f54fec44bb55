import numpy as np
import pytest
import torch

from echo.worker.pinned_ring import PinnedUploadRing

_SPIN = 200_000_000  # GPU clock cycles torch.cuda._sleep spins: ~0.1 s

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(params=["engine", "kernel"], autouse=True)
def step_copies(request, monkeypatch):
    """Each test with the uploads by the copy engine and by kernel (worker/host_copies.py)."""
    monkeypatch.setenv("ECHO_STEP_COPIES", request.param)
    return request.param


@pytest.mark.gpu
@gpu
def test_uploads_queue_behind_the_stream_without_blocking_the_host():
    ring = PinnedUploadRing(64, "cuda")
    # the copy kernel's first launch compiles it on the host, as the runner's warm-up does
    ring.upload([7])
    torch.cuda.synchronize()
    torch.cuda._sleep(_SPIN)
    behind_spin = torch.cuda.Event()
    behind_spin.record()
    # lengths no pinned block has had yet: pin_memory() would allocate, and so synchronize
    uploads = [(ring.upload(list(range(n, 2 * n))), n) for n in (3, 17, 30)]
    assert not behind_spin.query(), "an upload waited for the spinning stream"
    torch.cuda.synchronize()
    for on_device, n in uploads:
        assert on_device.device.type == "cuda" and on_device.dtype == torch.int64
        assert on_device.tolist() == list(range(n, 2 * n))


@pytest.mark.gpu
@gpu
def test_reused_ranges_wait_for_their_uploads_and_long_lists_grow_the_ring():
    ring = PinnedUploadRing(16, "cuda")
    torch.cuda._sleep(_SPIN)
    # 10 uploads of 7 wrap the ring of 16 again and again while the stream is still spinning:
    # a range rewritten before its copy ran would hand the copy the later list's values
    uploads = [(ring.upload([i * 100 + j for j in range(7)]), i) for i in range(10)]
    long = ring.upload(list(range(40)))
    assert ring.capacity == 40
    empty = ring.upload([])
    torch.cuda.synchronize()
    for on_device, i in uploads:
        assert on_device.tolist() == [i * 100 + j for j in range(7)]
    assert long.tolist() == list(range(40))
    assert empty.numel() == 0


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity"):
        PinnedUploadRing(0, "cpu")


@pytest.mark.gpu
@gpu
def test_an_int32_ring_uploads_arrays_as_int32():
    ring = PinnedUploadRing(8, "cuda", torch.int32)
    words = np.array([-1, 0, 2**31 - 1, -2**31, 7], dtype=np.int32)  # mask words: every bit
    on_device = ring.upload(words)
    again = ring.upload(words[::-1].copy())  # wraps the ring of 8
    torch.cuda.synchronize()
    assert on_device.dtype == torch.int32 and on_device.tolist() == words.tolist()
    assert again.tolist() == words[::-1].tolist()
