"""AWQ W4A16 weights as echo's layers hold them, converted from AutoAWQ's checkpoint tensors.

AutoAWQ's "gemm" checkpoints keep a layer of K inputs and N outputs K-major, packed along the
outputs (qweight int32 [K, N/8], qzeros int32 [K/G, N/8], scales [K/G, N]; linear.py). echo
keeps each output's weights together, as a dense weight [N, K] is kept:

    qweight int32 [N, K/8]   int32 p of row n holds q[n, 8p .. 8p + 7]
    qzeros  uint8 [N, K/G]   the zero point of each group, 0..15
    scales        [N, K/G]

    W[n, k] = (q[n, k] - z[n, k // G]) * s[n, k // G]

Why: at a few rows a linear layer is a read of its weight, and the one-row GEMV streams it
fastest when a program owns whole output rows over all of K (linear.py's whole-K tile: its share
loads in one piece before the PDL wait, and the RMSNorm before the layer and SwiGLU after it can
run in the same kernel). K-major rows give a program BLOCK_N / 2 bytes a row, so the AWQ GEMV had
to split K and add the splits in a second launch.

Inside an int32 the eight inputs keep AutoAWQ's interleaved order (input 8p + r at nibble
AWQ_REVERSE_ORDER[r]), so the kernels unpack both the way they unpacked AutoAWQ's columns
(echo_kernels/awq.py, _unpack_offsets).
"""

import torch

AWQ_PACK = 8  # 4-bit values per int32
# AutoAWQ's packer writes value 8j + [0, 2, 4, 6, 1, 3, 5, 7][i] at nibble i of int32 j; value
# 8j + r therefore sits at nibble AWQ_REVERSE_ORDER[r]
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] packed in AWQ's order -> uint8 [R, 8C] of the values 0..15, in order (a
    nibble at a time: no temporary 8x the int32 source)."""
    rows, cols = packed.shape
    values = torch.empty(rows, cols, AWQ_PACK, dtype=torch.uint8, device=packed.device)
    for r, nibble in enumerate(AWQ_REVERSE_ORDER):
        values[:, :, r] = (packed >> (4 * nibble)) & 15
    return values.view(rows, cols * AWQ_PACK)


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """uint8 [R, 8C] of 0..15 -> int32 [R, C] in AWQ's order. The nibbles' bits do not overlap,
    so adding them is OR-ing them; the top one goes in as a signed number times 2**28, which
    sets bit 31 without overflowing an int32."""
    rows, n = values.shape
    columns = values.view(rows, n // AWQ_PACK, AWQ_PACK)
    packed = torch.zeros(rows, n // AWQ_PACK, dtype=torch.int32, device=values.device)
    for i, column in enumerate(AWQ_PACK_ORDER):
        nibble = columns[:, :, column].to(torch.int32)
        if i == AWQ_PACK - 1:
            nibble -= 16 * (nibble >= 8)
        packed += nibble * (1 << (4 * i))
    return packed


def qweight_rows(qweight: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's qweight int32 [K, N/8] -> echo's [N, K/8]."""
    return pack_awq(unpack_awq(qweight).t().contiguous())


def qzeros_rows(qzeros: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's qzeros int32 [K/G, N/8] -> echo's uint8 [N, K/G]."""
    return unpack_awq(qzeros).t().contiguous()


def scales_rows(scales: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's scales [K/G, N] -> echo's [N, K/G]."""
    return scales.t().contiguous()


# a checkpoint tensor's name (its last part) -> its conversion to echo's layout
TO_ROWS = {"qweight": qweight_rows, "qzeros": qzeros_rows, "scales": scales_rows}
