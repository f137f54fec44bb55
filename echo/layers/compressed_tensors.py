"""compressed-tensors' W4A16 "pack-quantized" checkpoints (what llm-compressor writes) read as
AutoAWQ's tensors, so the same layers and kernels run both (linear.py describes AWQ's).

A pack-quantized linear layer `X` holds `X.weight_packed` int32 [out, in/8] (nibble i of int32 j
is input column 8j + i, holding q + 8 for the signed q in -8..7), `X.weight_scale` [out, in/G],
`X.weight_shape` [2] and, asymmetric only, `X.weight_zero_point` int32 [out/8, in/G] packed
along the output the same way (z + 8); W = (q - z) * s with z = 0 when symmetric. AWQ's tensors
are the transposes, packed along the output in its interleaved order. The offset of 8 cancels
in q - z, so the stored nibbles carry over unchanged, and a symmetric layer's zero points are
all 8.

Each converted tensor is lazy, like CheckpointTensor: a TP rank's narrow reads only the part of
the source it keeps (the rows of its output columns, or the columns of its input groups) and
converts that, on the device the weights go to.
"""

from collections.abc import Iterator

import torch

from echo.layers.checkpoint_tensor import whole
from echo.layers.quantization import AWQ_PACK, AwqConfig

_AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ's int32 j holds column 8j + this[i] at nibble i
_SYMMETRIC_ZEROS = 0x88888888 - 2**32  # eight nibbles of 8, as an int32


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' int32 packing along the last dimension -> uint8 values 0..15, 8x as
    many along it (a nibble at a time: no temporary 8x the int32 source)."""
    rows, cols = packed.shape
    values = torch.empty(rows, cols, AWQ_PACK, dtype=torch.uint8, device=packed.device)
    for i in range(AWQ_PACK):
        values[:, :, i] = (packed >> (4 * i)) & 15
    return values.view(rows, cols * AWQ_PACK)


def _pack_awq(values: torch.Tensor) -> torch.Tensor:
    """uint8 [R, N] of 0..15 -> int32 [R, N/8] in AWQ's order. The nibbles' bits do not overlap,
    so adding them is OR-ing them; the top one goes in as a signed number times 2**28, which
    sets bit 31 without overflowing an int32."""
    rows, n = values.shape
    columns = values.view(rows, n // AWQ_PACK, AWQ_PACK)
    packed = torch.zeros(rows, n // AWQ_PACK, dtype=torch.int32, device=values.device)
    for i, column in enumerate(_AWQ_PACK_ORDER):
        nibble = columns[:, :, column].to(torch.int32)
        if i == AWQ_PACK - 1:
            nibble -= 16 * (nibble >= 8)
        packed += nibble * (1 << (4 * i))
    return packed


class AwqView:
    """One AWQ tensor of a pack-quantized layer: `shape`, `narrow(dim, start, length)` and
    `whole()` as CheckpointTensor has them, converted when read. `source_name` is the
    checkpoint's tensor (for errors)."""

    def __init__(self, kind: str, source, source_name: str, device: torch.device):
        self.kind, self.source, self.source_name, self.device = kind, source, source_name, device
        if len(source.shape) != 2:
            raise ValueError(f"{source_name}: must be 2-D, got shape {tuple(source.shape)}")
        rows, cols = source.shape
        if kind == "qweight":  # [out, in/8] -> [in, out/8]
            self.shape = torch.Size((cols * AWQ_PACK, rows // AWQ_PACK))
        elif kind == "midpoints":  # symmetric zero points, shaped by scales [out, in/G]
            self.shape = torch.Size((cols, rows // AWQ_PACK))
        else:  # qzeros [out/8, in/G], scales [out, in/G]: transposed
            self.shape = torch.Size((cols, rows))

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if self.kind == "midpoints":
            shape = list(self.shape)
            shape[dim] = length
            return self._midpoints(shape)
        if self.kind == "qweight":
            # input rows come from packs of 8 along the source's last dimension; output packs
            # are 8 source rows each
            if dim == 0:
                if start % AWQ_PACK or length % AWQ_PACK:
                    raise ValueError(f"{self.source_name}: input features {start}.."
                                     f"{start + length} split a pack of {AWQ_PACK}")
                part = self.source.narrow(1, start // AWQ_PACK, length // AWQ_PACK)
            else:
                part = self.source.narrow(0, start * AWQ_PACK, length * AWQ_PACK)
        else:  # a transpose: the other dimension of the source
            part = self.source.narrow(1 - dim, start, length)
        return self._convert(part)

    def whole(self) -> torch.Tensor:
        if self.kind == "midpoints":
            return self._midpoints(list(self.shape))
        return self._convert(whole(self.source))

    def _midpoints(self, shape: list[int]) -> torch.Tensor:
        return torch.full(shape, _SYMMETRIC_ZEROS, dtype=torch.int32, device=self.device)

    def _convert(self, part: torch.Tensor) -> torch.Tensor:
        part = part.to(self.device)
        if self.kind == "scales":
            return part.t().contiguous()
        if part.dtype != torch.int32:
            raise ValueError(f"{self.source_name}: must be int32 (packed nibbles), got "
                             f"{part.dtype}")
        if self.kind == "qweight":  # packed along the inputs: unpack, then transpose
            return _pack_awq(_unpack(part).t().contiguous())
        return _pack_awq(_unpack(part.t()))  # qzeros, packed along the outputs: the reverse


# checkpoint suffix -> the AWQ tensor it becomes
_KINDS = {"weight_packed": "qweight", "weight_scale": "scales", "weight_zero_point": "qzeros"}


def as_awq_tensors(weights: Iterator[tuple[str, object]], quant: AwqConfig,
                   device: torch.device) -> Iterator[tuple[str, object]]:
    """A pack-quantized checkpoint's (name, tensor) stream with each quantized layer's tensors
    as AWQ's; everything else passes through. A symmetric layer's zero points (8) follow its
    scales."""
    for name, tensor in weights:
        base, _, suffix = name.rpartition(".")
        if suffix == "weight_shape":  # the layers' own shapes check the others
            continue
        if suffix == "weight_g_idx":
            raise ValueError(f"checkpoint tensor {name!r}: act-order (g_idx) is not supported")
        kind = _KINDS.get(suffix)
        if kind is None:
            yield name, tensor
            continue
        if kind == "qzeros" and quant.symmetric:
            continue  # an older writer's explicit zeros: symmetric means the midpoint anyway
        yield f"{base}.{kind}", AwqView(kind, tensor, name, device)
        if kind == "scales" and quant.symmetric:
            yield f"{base}.qzeros", AwqView("midpoints", tensor, name, device)
