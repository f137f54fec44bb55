"""Whether the peer-mapped all-reduces may be used: every ordered pair of GPUs must map the
other's memory."""

import pytest
import torch

from echo.distributed.symm_mem_all_reduce import gpus_reach_each_other


@pytest.mark.parametrize("world,missing,expected", [
    (1, set(), True),  # nothing to map
    (4, set(), True),
    (2, {(1, 0)}, False),  # one direction is enough to refuse
    (4, {(2, 3)}, False),
    (2, {(2, 3)}, True),  # GPUs outside the group do not matter
])
def test_every_ordered_pair_of_the_group_must_reach(monkeypatch, world, missing, expected):
    asked = []

    def can_access(a, b):
        asked.append((a, b))
        return (a, b) not in missing

    monkeypatch.setattr(torch.cuda, "can_device_access_peer", can_access)
    assert gpus_reach_each_other(world) is expected
    assert all(a != b and a < world and b < world for a, b in asked)
