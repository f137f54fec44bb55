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
