"""Persistent device tensors for a step's inputs, filled from the host in one pass per field.

The same tensors are the static inputs CUDA graphs are captured on, so eager and graph steps
share them. On CUDA the host side goes through pinned buffers, so copies are asynchronous; there
are two host sets, used by alternate steps, because a step's copies may still be queued behind
the previous step's kernels when the next step is prepared (two steps in flight).
"""

import numpy as np
import torch

from echo.attention.backend import AttentionMetadata
from echo.worker.input_batch import StepInputs


def longest_first(seq_lens: np.ndarray) -> np.ndarray:
    """Sequence indices by descending context length (AttentionMetadata.seq_order)."""
    return np.argsort(-seq_lens, kind="stable").astype(np.int32)


class StepBuffers:
    def __init__(self, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int,
                 device: torch.device):
        self.device = device
        self.max_blocks_per_seq = max_blocks_per_seq
        pin = device.type == "cuda"
        self.fields: dict[str, tuple[list[torch.Tensor], torch.Tensor]] = {}
        self.current = 0
        for name, size, dtype in (
            ("input_ids", max_num_tokens, torch.int64),
            ("positions", max_num_tokens, torch.int64),
            ("slot_mapping", max_num_tokens, torch.int64),
            ("cu_seqlens_q", max_num_seqs + 1, torch.int32),
            ("seq_lens", max_num_seqs, torch.int32),
            ("seq_order", max_num_seqs, torch.int32),
            # one row per sampling request, or 1 + its drafts under speculative decoding
            ("logits_indices", max_num_tokens, torch.int64),
            ("placeholder_idx", max_num_seqs, torch.int64),
            ("placeholder_src", max_num_seqs, torch.int64),
            ("block_table", max_num_seqs * max_blocks_per_seq, torch.int32),
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
            self.fields[name] = (hosts, dev)

    def flip(self) -> None:
        """Switch host sets: call once per step, before its first put()."""
        self.current ^= 1

    def put(self, name: str, values: np.ndarray) -> torch.Tensor:
        """Copy `values` into the front of the field; return the device view."""
        hosts, dev = self.fields[name]
        host = hosts[self.current]
        n = values.size
        host[:n].numpy()[:] = values.reshape(-1)
        dev[:n].copy_(host[:n], non_blocking=True)
        return dev[:n]

    def tensor(self, name: str) -> torch.Tensor:
        return self.fields[name][1]

    def load(self, inp: StepInputs, pad_seqs_to: int | None = None):
        """Upload a step's inputs. With pad_seqs_to (CUDA-graph replay of a batch whose
        sequences all run the same number of query tokens: decodes, or decodes verifying k
        drafts each) the batch is padded with dummy sequences of as many tokens that store
        nothing, and the block table keeps its full static width."""
        query_lens = np.diff(inp.cu_seqlens_q)
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
        width = table.shape[1]
        if pad_seqs_to is not None:
            num_seqs, q = len(seq_lens), meta["max_seqlen_q"]  # every sequence runs q tokens
            pad = pad_seqs_to - num_seqs
            input_ids = np.concatenate([input_ids, np.zeros(pad * q, np.int64)])
            positions = np.concatenate([positions, np.tile(np.arange(q), pad)])
            slots = np.concatenate([slots, np.full(pad * q, -1, np.int64)])
            seq_lens = np.concatenate([seq_lens, np.full(pad, q, np.int32)])
            cu = np.arange(0, (pad_seqs_to + 1) * q, q, dtype=np.int32)
            width = self.max_blocks_per_seq
            full = np.zeros((pad_seqs_to, width), np.int32)
            full[:num_seqs, : table.shape[1]] = table
            table = full
        rows = len(seq_lens)
        attention = AttentionMetadata(
            slot_mapping=self.put("slot_mapping", slots),
            block_table=self.put("block_table", table).view(rows, width),
            cu_seqlens_q=self.put("cu_seqlens_q", cu),
            seq_lens=self.put("seq_lens", seq_lens),
            seq_order=self.put("seq_order", longest_first(seq_lens)),
            **meta,
        )
        return self.put("input_ids", input_ids), self.put("positions", positions), attention
