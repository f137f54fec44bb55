"""advance_decode: the one-kernel step between decode steps against its PyTorch twin and by
hand."""

import pytest
import torch

from echo_kernels.decode_advance import advance_decode
from echo_kernels.reference import advance_decode_ref


def _inputs(rows: int, table_rows: int, width: int, block_size: int, device, seed: int):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    block_table = torch.randperm(10_000, generator=gen)[:table_rows * width].view(
        table_rows, width).to(torch.int32)
    # positions up to past the table's last block (a launch's steps beyond its allocation)
    positions = torch.randint(0, width * block_size + 3, (table_rows,), generator=gen)
    slots = torch.randint(0, 10_000, (table_rows,), generator=gen)
    slots[torch.rand(table_rows, generator=gen) < 0.25] = -1  # padding rows
    tensors = dict(
        input_ids=torch.randint(0, 50_000, (table_rows,), generator=gen), positions=positions,
        slots=slots, seq_lens=(positions + 1).to(torch.int32),
        sample_steps=torch.randint(0, 100, (table_rows,), generator=gen),
        tokens=torch.randint(0, 50_000, (rows,), generator=gen), block_table=block_table)
    return {name: t.to(device) for name, t in tensors.items()}


@pytest.mark.parametrize("rows", [1, 5, 37, 300])  # 300: three programs
@pytest.mark.parametrize("max_position", [None, 40])
def test_matches_reference(device, rows, max_position):
    # the table and buffers hold more rows than the batch (a captured graph's size): rows past
    # it are left alone
    inputs = _inputs(rows, rows + 3, 5, 16, device, seed=rows)
    got = {name: t.clone() for name, t in inputs.items()}
    want = {name: t.clone() for name, t in inputs.items()}
    advance_decode(*got.values(), 16, max_position)
    advance_decode_ref(*want.values(), 16, max_position)
    for name in inputs:
        assert torch.equal(got[name], want[name]), name
    assert torch.equal(got["positions"][rows:], inputs["positions"][rows:])


def test_by_hand(device):
    """Block size 4, table rows [7, 3, 9] and [5, 6, 0]: row 0 at position 3 (block 7) moves to
    position 4, the first slot of block 3: 12; row 1 at position 9 reaches max_position 10 and
    stores nothing (slot -1, position held at 9); row 2 is padding and stays."""
    t = dict(
        input_ids=torch.tensor([11, 12, 13]), positions=torch.tensor([3, 9, 0]),
        slots=torch.tensor([31, 25, -1]), seq_lens=torch.tensor([4, 10, 1], dtype=torch.int32),
        sample_steps=torch.tensor([2, 0, 0]), tokens=torch.tensor([101, 102, 103]),
        block_table=torch.tensor([[7, 3, 9], [5, 6, 0], [0, 0, 0]], dtype=torch.int32))
    t = {name: x.to(device) for name, x in t.items()}
    advance_decode(*t.values(), 4, max_position=10)
    assert t["input_ids"].tolist() == [101, 102, 13]
    assert t["positions"].tolist() == [4, 9, 0]
    assert t["seq_lens"].tolist() == [5, 11, 1]
    assert t["sample_steps"].tolist() == [3, 1, 0]
    assert t["slots"].tolist() == [12, -1, -1]
