"""Uploads of variable-length integer lists through one pinned buffer, allocated once.

Allocating pinned memory synchronizes the whole device (page-locked allocation is one of CUDA's
implicit synchronizations), and torch's caching host allocator (`pin_memory()`) makes such an
allocation whenever no cached block of a list's size class is free: a block-id list of a new
length would stall the host behind every kernel and copy queued on the GPU — for the KV host
tier, behind hundreds of milliseconds of earlier loads. The ring hands out consecutive ranges of
one buffer instead and reuses a range once the event recorded after its upload has completed;
uploads run in order on their stream, so ranges free in the order they were taken.
"""

from collections import deque

import torch

from echo.worker.host_copies import copies_by_kernel, copy_pinned


class PinnedUploadRing:
    """Lists or arrays of numbers copied to a CUDA device through a pinned ring of `capacity`
    elements of `dtype` (grown, with the one synchronizing allocation, when a single list is
    longer)."""

    def __init__(self, capacity: int, device: torch.device, dtype: torch.dtype = torch.int64):
        if capacity < 1:
            raise ValueError(f"capacity: must be >= 1, got {capacity}")
        self.device = torch.device(device)
        self.dtype = dtype
        self._by_kernel = copies_by_kernel(self.device)
        self._in_flight: deque[tuple[int, int, torch.cuda.Event]] = deque()  # start, end, done
        self._allocate(capacity)

    @property
    def capacity(self) -> int:
        return len(self._view)

    def _allocate(self, capacity: int) -> None:
        # the old buffer, if any, must outlive its uploads: torch's host allocator knows of a
        # copy_'s use but not of a kernel's (host_copies.py), so wait for the last one
        if self._in_flight:
            self._in_flight[-1][2].synchronize()
            self._in_flight.clear()
        self._host = torch.empty(capacity, dtype=self.dtype, pin_memory=True)
        self._view = self._host.numpy()
        self._head = 0

    def upload(self, values) -> torch.Tensor:
        """`values` (a list or a 1-D array) as a tensor of the ring's dtype on the device,
        copied on the current stream; returns at once. Blocks the host only when the ring is
        too small for the uploads still queued."""
        n = len(values)
        if n > self.capacity:
            self._allocate(max(n, 2 * self.capacity))
        start = self._head if self._head + n <= self.capacity else 0
        end = start + n
        while self._in_flight and self._in_flight[0][2].query():
            self._in_flight.popleft()
        # the oldest ranges are reused first: wait for every upload up to the last one overlapping
        while any(s < end and start < e for s, e, _ in self._in_flight):
            self._in_flight.popleft()[2].synchronize()
        self._view[start:end] = values
        on_device = copy_pinned(torch.empty(n, dtype=self.dtype, device=self.device),
                                self._host[start:end], self._by_kernel)
        done = torch.cuda.Event()
        done.record()
        self._in_flight.append((start, end, done))
        self._head = end
        return on_device
