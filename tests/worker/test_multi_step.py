"""The device-side advance between two decode steps of one launch, by hand."""

import numpy as np
import torch

from echo.worker.input_batch import StepInputs
from echo.worker.multi_step import advance_decode_inputs, advanced_metadata
from echo.worker.step_buffers import StepBuffers


def test_advance_by_hand():
    """Two sequences (block size 4) and a padding row: sequence 0 at position 7 (the last slot
    of its second block, 13) moves to position 8, the first slot of its third block (block 2,
    slot 8); sequence 1 at position 1 of block 5 moves to slot 22. The padding row stays."""
    buffers = StepBuffers(max_num_tokens=8, max_num_seqs=4, max_blocks_per_seq=3,
                          device=torch.device("cpu"))
    inp = StepInputs(
        req_ids=["a", "b"], rows=np.array([0, 1]), input_ids=np.array([11, 12]),
        positions=np.array([7, 1]), slot_mapping=np.array([13, 21]),
        block_table=np.array([[0, 3, 2], [5, 0, 0]], dtype=np.int32),
        cu_seqlens_q=np.array([0, 1, 2], dtype=np.int32), seq_lens=np.array([8, 2], np.int32),
        sample_seq_idx=np.array([0, 1]), logits_indices=np.array([0, 1]),
        placeholder_idx=np.zeros(0, np.int64), placeholder_rows=np.zeros(0, np.int64))
    ids, positions, meta = buffers.load(inp, pad_seqs_to=3)
    steps = buffers.put("sample_steps", np.array([4, 0, 0]))
    advance_decode_inputs(ids, positions, meta, steps, torch.tensor([101, 102, 103]), 4)
    assert ids.tolist() == [101, 102, 0]
    assert positions.tolist() == [8, 2, 0]
    assert meta.seq_lens.tolist() == [9, 3, 1]
    assert meta.slot_mapping.tolist() == [8, 22, -1]
    assert steps.tolist() == [5, 1, 0]
    # past the last allocated block (position 12 of a 3-block table): the slot is clamped to
    # the table, never out of it
    for _ in range(4):
        advance_decode_inputs(ids, positions, meta, steps, torch.tensor([1, 1, 1]), 4)
    assert positions[0] == 12
    later = advanced_metadata(meta, 4)
    assert later.max_seqlen_k == meta.max_seqlen_k + 4 == 12
    assert later.seq_lens_cpu == (12, 6) and not later.no_cached_prefix
