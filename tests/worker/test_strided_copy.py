"""Strided copies: `height` rows of `width` bytes between pitches, by hand on the CPU (memmove row
by row) and by the copy engine on the GPU (cuMemcpy2DAsync), against slicing."""

import pytest
import torch

from echo.worker.strided_copy import StridedCopier, max_pitch


def test_cpu_rows_go_from_one_pitch_to_the_other():
    src = torch.arange(24, dtype=torch.uint8)  # rows of pitch 8: 0..7, 8..15, 16..23
    dst = torch.zeros(15, dtype=torch.uint8)  # rows of pitch 5
    StridedCopier(to_device=True).copy(dst.data_ptr() + 1, 5, src.data_ptr() + 2, 8, 3, 3)
    assert dst.tolist() == [0, 2, 3, 4, 0, 0, 10, 11, 12, 0, 0, 18, 19, 20, 0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_strided_device_rows_to_pinned_host_and_back():
    device = torch.device("cuda")
    cache = torch.randint(0, 256, (6, 40), dtype=torch.uint8, device=device)  # pitch 40
    host = torch.zeros(6, 16, dtype=torch.uint8).pin_memory()  # pitch 16
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream())
    StridedCopier(to_device=False, stream=stream).copy(host.data_ptr(), 16,
                                                       cache.data_ptr() + 8, 40, 16, 6)
    stream.synchronize()
    assert torch.equal(host, cache[:, 8:24].cpu())
    StridedCopier(to_device=True, stream=stream).copy(cache.data_ptr() + 20, 40,
                                                      host.data_ptr(), 16, 16, 6)
    stream.synchronize()
    assert torch.equal(cache[:, 20:36].cpu(), host)
    assert max_pitch(torch.cuda.current_device()) >= 40  # the driver answers
