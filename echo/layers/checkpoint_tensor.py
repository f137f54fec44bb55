"""A checkpoint tensor read only in the part a tensor-parallel rank keeps.

Weight loaders take either a torch.Tensor or a CheckpointTensor (a safetensors slice that has
not been read yet) and use only `.shape`, `.narrow(dim, start, length)` and `whole(x)`, so a
rank of an 8B model at tp=2 reads its half of each sharded matrix from disk, never the whole
matrix: no rank materializes what it does not keep.
"""

import torch


class CheckpointTensor:
    def __init__(self, checkpoint_slice):
        self._slice = checkpoint_slice  # safetensors' PySafeSlice: indexing reads just that
        self.shape = torch.Size(checkpoint_slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._slice[tuple(index)]

    def whole(self) -> torch.Tensor:
        return self._slice[tuple(slice(None) for _ in self.shape)]


def whole(x: "torch.Tensor | CheckpointTensor") -> torch.Tensor:
    """All of x, as a tensor (read from the checkpoint now if it is a CheckpointTensor or
    another lazy view with `whole()`, such as compressed_tensors.AwqView)."""
    return x if isinstance(x, torch.Tensor) else x.whole()
