"""StepBuffers uploads a step's inputs into persistent tensors (on CPU here: no pinned memory)."""

import numpy as np
import torch

from echo.worker.input_batch import StepInputs
from echo.worker.step_buffers import StepBuffers, longest_first


def test_longest_first_is_a_stable_descending_order():
    assert longest_first(np.array([3, 9, 1, 9, 3], np.int32)).tolist() == [1, 3, 0, 4, 2]


def test_load_fills_metadata_and_pads_graph_batches():
    buffers = StepBuffers(max_num_tokens=16, max_num_seqs=4, max_blocks_per_seq=3,
                          device=torch.device("cpu"))
    fields = dict(input_ids=np.array([5, 6, 7, 8], np.int64), positions=np.array([0, 1, 9, 3]),
                  slot_mapping=np.array([0, 1, 25, 40], np.int64),
                  cu_seqlens_q=np.array([0, 2, 3, 4], np.int32),
                  seq_lens=np.array([2, 10, 4], np.int32),
                  block_table=np.array([[0, 0], [1, 2], [3, 0]], np.int32))
    none = np.zeros(0, np.int64)
    inp = StepInputs(req_ids=["a", "b", "c"], rows=np.arange(3), sample_seq_idx=np.arange(3),
                     logits_indices=np.array([1, 2, 3]), placeholder_idx=none,
                     placeholder_rows=none, **fields)
    buffers.flip()
    ids, positions, meta = buffers.load(inp)
    assert ids.tolist() == [5, 6, 7, 8] and positions.tolist() == [0, 1, 9, 3]
    assert meta.seq_lens.tolist() == [2, 10, 4] and meta.seq_order.tolist() == [1, 2, 0]
    assert meta.max_seqlen_q == 2 and meta.max_seqlen_k == 10 and not meta.no_cached_prefix
    assert meta.block_table.tolist() == [[0, 0], [1, 2], [3, 0]]

    # a CUDA-graph batch of 4 from 3 sequences of 2 query tokens each (decodes verifying one
    # draft): one dummy sequence of 2 tokens that stores nothing, sorted last
    uniform = StepInputs(
        req_ids=["a", "b", "c"], rows=np.arange(3), sample_seq_idx=np.arange(3),
        logits_indices=np.arange(6), placeholder_idx=none, placeholder_rows=none,
        input_ids=np.arange(6, dtype=np.int64), positions=np.array([3, 4, 8, 9, 2, 3]),
        slot_mapping=np.array([3, 4, 24, 25, 50, 51], np.int64),
        cu_seqlens_q=np.array([0, 2, 4, 6], np.int32), seq_lens=np.array([5, 10, 4], np.int32),
        block_table=np.array([[0, 0], [1, 2], [3, 0]], np.int32))
    buffers.flip()
    ids, positions, meta = buffers.load(uniform, pad_seqs_to=4)
    assert meta.seq_lens.tolist() == [5, 10, 4, 2] and meta.seq_order.tolist() == [1, 0, 2, 3]
    assert meta.cu_seqlens_q.tolist() == [0, 2, 4, 6, 8] and meta.max_seqlen_q == 2
    assert meta.slot_mapping.tolist()[-2:] == [-1, -1] and meta.block_table.shape == (4, 3)
    assert positions.tolist()[-2:] == [0, 1] and ids.tolist() == [0, 1, 2, 3, 4, 5, 0, 0]


def test_packed_fields_sit_where_the_shape_puts_them():
    """A CUDA graph reads its inputs at fixed addresses: loads of the same padded shape land
    in the same views whatever was loaded between them, fields start 64-byte aligned, and an
    eager step of another shape neither moves them nor corrupts the next padded load."""
    buffers = StepBuffers(max_num_tokens=32, max_num_seqs=4, max_blocks_per_seq=3,
                          device=torch.device("cpu"))
    none = np.zeros(0, np.int64)

    def decodes(n: int, base: int) -> StepInputs:
        return StepInputs(
            req_ids=[str(i) for i in range(n)], rows=np.arange(n), sample_seq_idx=np.arange(n),
            logits_indices=np.arange(n), placeholder_idx=none, placeholder_rows=none,
            input_ids=np.arange(base, base + n, dtype=np.int64),
            positions=np.arange(5, 5 + n, dtype=np.int64),
            slot_mapping=np.arange(20, 20 + n, dtype=np.int64),
            cu_seqlens_q=np.arange(n + 1, dtype=np.int32),
            seq_lens=np.arange(6, 6 + n, dtype=np.int32),
            block_table=np.full((n, 2), 7, np.int32))

    first = buffers.load(decodes(2, 100), pad_seqs_to=4)
    tensors = [first[0], first[1], first[2].slot_mapping, first[2].cu_seqlens_q,
               first[2].seq_lens, first[2].seq_order, first[2].block_table]
    assert all(t.data_ptr() % 64 == 0 for t in tensors)
    assert len({t.data_ptr() for t in tensors}) == len(tensors)
    buffers.flip()
    prefill = StepInputs(
        req_ids=["p"], rows=np.arange(1), sample_seq_idx=np.arange(1),
        logits_indices=np.array([8]), placeholder_idx=none, placeholder_rows=none,
        input_ids=np.arange(9, dtype=np.int64), positions=np.arange(9, dtype=np.int64),
        slot_mapping=np.arange(9, dtype=np.int64), cu_seqlens_q=np.array([0, 9], np.int32),
        seq_lens=np.array([9], np.int32), block_table=np.array([[1]], np.int32))
    ids, _, meta = buffers.load(prefill)
    assert ids.tolist() == list(range(9)) and meta.block_table.tolist() == [[1]]
    buffers.flip()
    again = buffers.load(decodes(3, 200), pad_seqs_to=4)
    assert again[0].data_ptr() == first[0].data_ptr()
    assert again[2].block_table.data_ptr() == first[2].block_table.data_ptr()
    assert again[0].tolist() == [200, 201, 202, 0]
    assert again[1].tolist() == [5, 6, 7, 0] and again[2].slot_mapping.tolist() == [20, 21, 22, -1]
    assert again[2].seq_lens.tolist() == [6, 7, 8, 1]
    assert again[2].cu_seqlens_q.tolist() == [0, 1, 2, 3, 4]
    assert again[2].block_table.tolist() == [[7, 7, 0], [7, 7, 0], [7, 7, 0], [0, 0, 0]]
    assert again[2].seq_order.tolist() == [2, 1, 0, 3]
