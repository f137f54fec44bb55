"""Persistent device tensors for a step's inputs, filled from the host.

The same tensors are the static inputs CUDA graphs are captured on, so eager and graph steps
share them. On CUDA the host side goes through pinned buffers, so copies are asynchronous; there
are two host sets, used by alternate steps, because a step's copies may still be queued behind
the previous step's kernels when the next step is prepared (two steps in flight).

The forward's own inputs (token ids, positions, KV slots, query offsets, context lengths, their
order, the block table) travel in one upload: written back to back into one pinned buffer, one
copy to one device buffer, each field a view of it. Their offsets depend on the step's shape
alone (tokens, sequences, block-table width), so a CUDA graph captured at a batch size reads
its inputs where every replay at that size writes them. One copy instead of seven is what a
step at batch 1 saves: with one step in flight (speculative decoding) the device waits through
every copy's host cost (docs/benchmarks.md, Speculative decoding). The other fields (sampling
and verification settings) are uploaded one by one, after the forward is launched.
"""

import numpy as np
import torch

from echo.attention.backend import AttentionMetadata
from echo.worker.host_copies import copies_by_kernel, copy_pinned
from echo.worker.input_batch import StepInputs

# each packed field starts at a multiple of this many bytes: Triton specializes kernels on
# 16-byte-aligned pointers, and a field's alignment must not vary with the step's shape (a new
# specialization would compile in the middle of serving)
FIELD_ALIGN = 64
# step shapes whose views are kept: slicing a shape's fifteen views anew costs a step tens of
# µs, as much as its copy; the cap bounds them when prefill shapes keep changing
VIEWS_KEPT = 1024


def longest_first(seq_lens: np.ndarray) -> np.ndarray:
    """Sequence indices by descending context length (AttentionMetadata.seq_order)."""
    return (-seq_lens).argsort(kind="stable").astype(np.int32)


def packed_fields(num_tokens: int, num_seqs: int, width: int) -> list[tuple[torch.dtype, int]]:
    """The packed upload's fields in order, as (dtype, elements): input_ids, positions,
    slot_mapping (int64, one per token), cu_seqlens_q (int32, seqs + 1), seq_lens, seq_order
    (int32, one per sequence) and the block table (int32, seqs x width)."""
    return [(torch.int64, num_tokens)] * 3 + [
        (torch.int32, num_seqs + 1), (torch.int32, num_seqs), (torch.int32, num_seqs),
        (torch.int32, num_seqs * width)]


def packed_layout(num_tokens: int, num_seqs: int, width: int) -> tuple[list[int], int]:
    """Byte offsets of packed_fields in the upload, and its total bytes."""
    offsets, at = [], 0
    for dtype, count in packed_fields(num_tokens, num_seqs, width):
        offsets.append(at)
        at += -(-count * dtype.itemsize // FIELD_ALIGN) * FIELD_ALIGN
    return offsets, at


class StepBuffers:
    def __init__(self, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int,
                 device: torch.device):
        self.device = device
        self.max_blocks_per_seq = max_blocks_per_seq
        pin = device.type == "cuda"
        self._by_kernel = copies_by_kernel(device)
        _, packed_bytes = packed_layout(max_num_tokens, max_num_seqs, max_blocks_per_seq)
        self.packed_hosts = [torch.zeros(packed_bytes, dtype=torch.uint8, pin_memory=pin)
                             for _ in range(2)]
        self.packed = torch.zeros(packed_bytes, dtype=torch.uint8, device=device)
        # shape (tokens, seqs, width) -> _views_of's views of it (cleared past VIEWS_KEPT)
        self._views: dict[tuple[int, int, int], tuple] = {}
        # the other fields: name -> (host arrays, host tensors, device tensor)
        self.fields: dict[str, tuple[list[np.ndarray], list[torch.Tensor], torch.Tensor]] = {}
        self.current = 0
        for name, size, dtype in (
            # one row per sampling request, or 1 + its drafts under speculative decoding
            ("logits_indices", max_num_tokens, torch.int64),
            ("placeholder_idx", max_num_seqs, torch.int64),
            ("placeholder_src", max_num_seqs, torch.int64),
            # plain sampling of several decode steps per launch (worker/multi_step.py), and
            # the requests verifying drafts (worker/rejection_sampler.py)
            ("temperature", max_num_seqs, torch.float32),
            ("seeds", max_num_seqs, torch.int64),
            ("sample_steps", max_num_seqs, torch.int64),
            ("draft_ids", max_num_tokens, torch.int64),
            ("cu_draft_rows", max_num_seqs + 1, torch.int32),
        ):
            hosts = [torch.zeros(size, dtype=dtype, pin_memory=pin) for _ in range(2)]
            dev = torch.zeros(size, dtype=dtype, device=device)
            self.fields[name] = ([host.numpy() for host in hosts], hosts, dev)

    def flip(self) -> None:
        """Switch host sets: call once per step, before its first put()."""
        self.current ^= 1

    def put(self, name: str, values: np.ndarray) -> torch.Tensor:
        """Copy `values` into the front of the field; return the device view."""
        arrays, hosts, dev = self.fields[name]
        n = values.size
        arrays[self.current][:n] = values.reshape(-1)
        copy_pinned(dev[:n], hosts[self.current][:n], self._by_kernel)
        return dev[:n]

    def tensor(self, name: str) -> torch.Tensor:
        """A field's whole device tensor (not the packed inputs: those are load()'s views)."""
        return self.fields[name][2]

    def load(self, inp: StepInputs, pad_seqs_to: int | None = None):
        """Upload a step's inputs: (input_ids, positions, AttentionMetadata), device views of
        the packed upload. With pad_seqs_to (CUDA-graph replay of a batch whose sequences all
        run the same number of query tokens: decodes, or decodes verifying k drafts each) the
        batch is padded with dummy sequences of as many tokens that store nothing, and the
        block table keeps its full static width."""
        cu = inp.cu_seqlens_q
        query_lens = cu[1:] - cu[:-1]
        return self._upload(
            inp.input_ids, inp.positions, inp.slot_mapping, inp.seq_lens, inp.cu_seqlens_q,
            inp.block_table, pad_seqs_to, max_seqlen_q=int(query_lens.max()),
            max_seqlen_k=int(inp.seq_lens.max()),
            no_cached_prefix=bool((query_lens == inp.seq_lens).all()),
            query_lens_cpu=tuple(query_lens.tolist()), seq_lens_cpu=tuple(inp.seq_lens.tolist()))

    def load_padding(self, num_seqs: int, max_seqlen_k: int, query_len: int = 1):
        """A batch of padding only (sequences of query_len tokens that store nothing), planned
        for contexts up to max_seqlen_k: the inputs CUDA graphs are captured on."""
        no_tokens = np.zeros(0, np.int64)
        return self._upload(no_tokens, no_tokens, no_tokens, np.zeros(0, np.int32),
                            np.zeros(1, np.int32), np.zeros((0, 1), np.int32), num_seqs,
                            max_seqlen_q=query_len, max_seqlen_k=max_seqlen_k)

    def _upload(self, input_ids, positions, slots, seq_lens, cu, table, pad_seqs_to, **meta):
        num_seqs, num_tokens, width = len(seq_lens), len(input_ids), table.shape[1]
        rows, tokens = num_seqs, num_tokens
        if pad_seqs_to is not None:  # every sequence runs max_seqlen_q tokens
            q = meta["max_seqlen_q"]
            rows, tokens, width = pad_seqs_to, pad_seqs_to * q, self.max_blocks_per_seq
        key = (tokens, rows, width)
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= VIEWS_KEPT:
                self._views.clear()
            views = self._views[key] = self._views_of(tokens, rows, width)
        host_views, host_bytes, device_views, device_bytes = views
        ids_h, positions_h, slots_h, cu_h, seq_lens_h, order_h, table_h = host_views[self.current]
        ids_h[:num_tokens], positions_h[:num_tokens] = input_ids, positions
        slots_h[:num_tokens], seq_lens_h[:num_seqs] = slots, seq_lens
        table_h[:num_seqs, :table.shape[1]] = table
        if pad_seqs_to is None:
            cu_h[:] = cu
        else:  # padding sequences of q tokens at positions 0 .. q - 1 that store nothing
            ids_h[num_tokens:] = 0
            positions_h[num_tokens:].reshape(-1, q)[:] = np.arange(q)
            slots_h[num_tokens:] = -1
            seq_lens_h[num_seqs:] = q
            cu_h[:] = np.arange(0, (rows + 1) * q, q)
            table_h[:num_seqs, table.shape[1]:] = 0
            table_h[num_seqs:] = 0
        order_h[:] = longest_first(seq_lens_h)
        copy_pinned(device_bytes, host_bytes[self.current], self._by_kernel)
        ids, positions_d, slots_d, cu_d, seq_lens_d, order_d, table_d = device_views
        attention = AttentionMetadata(slot_mapping=slots_d, block_table=table_d,
                                      cu_seqlens_q=cu_d, seq_lens=seq_lens_d, seq_order=order_d,
                                      **meta)
        return ids, positions_d, attention

    def _views_of(self, tokens: int, rows: int, width: int):
        """The packed fields of a step shape: their views in each host set and on the device
        (input_ids, positions, slot_mapping, cu_seqlens_q, seq_lens, seq_order, block_table),
        and the bytes to copy, in each host set and on the device."""
        offsets, total = packed_layout(tokens, rows, width)
        fields = packed_fields(tokens, rows, width)
        spans = [(at, at + count * dtype.itemsize) for at, (dtype, count) in zip(offsets, fields)]
        host_views = []
        for host in self.packed_hosts:  # numpy arrays over the pinned memory
            views = [host[a:b].view(dtype).numpy() for (a, b), (dtype, _) in zip(spans, fields)]
            views[-1] = views[-1].reshape(rows, width)
            host_views.append(views)
        device_views = [self.packed[a:b].view(dtype) for (a, b), (dtype, _) in zip(spans, fields)]
        device_views[-1] = device_views[-1].view(rows, width)
        return (host_views, [host[:total] for host in self.packed_hosts], tuple(device_views),
                self.packed[:total])
