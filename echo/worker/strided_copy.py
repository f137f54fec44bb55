"""Strided copies between host and device memory by the copy engine: `height` rows of `width`
bytes, rows `src_pitch` apart in the source and `dst_pitch` in the destination.

PyTorch has no such call: `copy_` between a pinned host tensor and a strided device view goes
through a device temporary and a copy kernel. On CUDA this is the driver's cuMemcpy2DAsync on a
given stream (asynchronous from pinned host memory, no SM involved); on the CPU (tests, CI) the
same arguments are applied row by row with memmove, so the address arithmetic that callers do
is checked without a GPU.
"""

import ctypes
import functools

_HOST, _DEVICE = 1, 2  # CUmemorytype
_MAX_PITCH = 11  # CU_DEVICE_ATTRIBUTE_MAX_PITCH


class _Memcpy2D(ctypes.Structure):
    """CUDA_MEMCPY2D (cuda.h, the _v2 layout: size_t offsets, pitches and extents)."""

    _fields_ = [("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t),
                ("srcMemoryType", ctypes.c_int), ("srcHost", ctypes.c_void_p),
                ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
                ("srcPitch", ctypes.c_size_t),
                ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t),
                ("dstMemoryType", ctypes.c_int), ("dstHost", ctypes.c_void_p),
                ("dstDevice", ctypes.c_uint64), ("dstArray", ctypes.c_void_p),
                ("dstPitch", ctypes.c_size_t),
                ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t)]


@functools.cache
def _driver():
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuMemcpy2DAsync_v2.argtypes = [ctypes.POINTER(_Memcpy2D), ctypes.c_void_p]
    lib.cuMemcpy2DAsync_v2.restype = ctypes.c_int
    lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return lib


def _check(result: int, call: str) -> None:
    if result != 0:
        message = ctypes.c_char_p()
        _driver().cuGetErrorString(result, ctypes.byref(message))
        raise RuntimeError(f"{call}: error {result} ({(message.value or b'?').decode()})")


def max_pitch(device_index: int) -> int:
    """The largest pitch a strided copy may have on this CUDA device (the driver refuses
    more)."""
    lib, device, value = _driver(), ctypes.c_int(), ctypes.c_int()
    _check(lib.cuDeviceGet(ctypes.byref(device), device_index), "cuDeviceGet")
    _check(lib.cuDeviceGetAttribute(ctypes.byref(value), _MAX_PITCH, device),
           "cuDeviceGetAttribute")
    return value.value


class StridedCopier:
    """Issues strided copies in one direction on one CUDA stream (`stream`: a
    torch.cuda.Stream), or on the CPU when stream is None. Reuses one descriptor: a copy costs
    the host a few field writes and the driver call."""

    def __init__(self, to_device: bool, stream=None):
        self.stream = stream
        if stream is None:
            return
        self._lib = _driver()
        self._handle = ctypes.c_void_p(stream.cuda_stream)
        self._desc = desc = _Memcpy2D()
        desc.srcMemoryType = _HOST if to_device else _DEVICE
        desc.dstMemoryType = _DEVICE if to_device else _HOST
        self._to_device = to_device

    def copy(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int,
             height: int) -> None:
        """Addresses are data_ptr() values plus byte offsets."""
        if self.stream is None:
            for row in range(height):
                ctypes.memmove(dst + row * dst_pitch, src + row * src_pitch, width)
            return
        desc = self._desc
        if self._to_device:
            desc.srcHost, desc.dstDevice = src, dst
        else:
            desc.srcDevice, desc.dstHost = src, dst
        desc.srcPitch, desc.dstPitch = src_pitch, dst_pitch
        desc.WidthInBytes, desc.Height = width, height
        _check(self._lib.cuMemcpy2DAsync_v2(ctypes.byref(desc), self._handle),
               "cuMemcpy2DAsync")
