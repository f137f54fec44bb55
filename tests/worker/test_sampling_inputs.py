"""Sampling uploads: each row of a stacked upload starts 16 bytes after the previous one."""

import numpy as np
import pytest

from echo.worker.sampling_inputs import rows_16_byte_aligned


@pytest.mark.parametrize("dtype, n, width", [(np.float32, 3, 4), (np.float32, 8, 8),
                                             (np.int64, 3, 4), (np.int64, 2, 2),
                                             (np.int64, 1, 2), (np.float32, 0, 0)])
def test_rows_are_padded_to_16_bytes(dtype, n, width):
    array = np.arange(3 * n, dtype=dtype).reshape(3, n)
    padded = rows_16_byte_aligned(array)
    assert padded.shape == (3, width) and padded.dtype == dtype
    assert (padded.strides[0] % 16 == 0) or width == 0
    assert np.array_equal(padded[:, :n], array) and not padded[:, n:].any()
