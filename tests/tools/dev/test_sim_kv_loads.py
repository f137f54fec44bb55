"""sim_kv_loads: the device-time model against hand-computed steps, and the engine's own join
rule through it on a small workload."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools" / "dev"))

from sim_kv_loads import DeviceClock, parse_args, simulate  # noqa: E402

from echo.core.sched_output import KVTransfer  # noqa: E402


def plan(tokens: dict[str, int], *transfers: KVTransfer):
    return SimpleNamespace(num_scheduled_tokens=tokens, kv_transfers=list(transfers))


def test_a_step_waits_for_its_joined_load_and_the_copies_queued_before_it():
    # 1 ms a block; a step: 1 ms + 0.1 a prefill token + 0.5 a decoding request
    clock = DeviceClock(parse_args(["--block-mb", "1", "--copy-gbps", "1", "--step-ms", "1",
                                    "--prefill-ms", "0.1", "--decode-ms", "0.5"]))
    assert clock.run(plan({"a": 20, "b": 1})) == pytest.approx(3.5)  # 1 + 2 + 0.5, 0 to 3.5
    # a store of 2 blocks waits for the step before (ends at 3.5): 5.5; then a joined load of
    # 3 blocks (unordered: it could start at 0, but queues behind the store): 8.5, so the step
    # starts at 8.5, not 3.5, and runs 1.5 ms
    store = KVTransfer(0, [(0, 0), (1, 1)], [], False, True)
    load = KVTransfer(1, [], [(2, 2), (3, 3), (4, 4)], True, False)
    assert clock.run(plan({"a": 1, "c": 1}, store, load)) == pytest.approx(8.5 + 2.0)
    assert clock.stall_ms == pytest.approx(5.0)
    # an unordered load alone starts beside the step in flight (from 8.5): lands at 11.5,
    # after that step ends at 10.5: one more millisecond of stall
    load = KVTransfer(2, [], [(5, 5), (6, 6), (7, 7)], True, False)
    assert clock.run(plan({"a": 1}, load)) == pytest.approx(11.5 + 1.5)
    assert clock.stall_ms == pytest.approx(6.0)


def test_the_engines_join_rule_decides_which_loads_join():
    # six conversations of up to 9 blocks (a 4-block system prompt shared) over 16 GPU blocks;
    # a prefill token costs 1 ms, so a load (two 7 ms steps) beats recomputing a history
    args = parse_args(["--conversations", "6", "--turns", "4", "--system-len", "64",
                       "--user-len", "16", "--output-len", "4", "--max-concurrency", "3",
                       "--gpu-blocks", "16", "--host-blocks", "256", "--prefill-ms", "1"])
    none = simulate(args, 0, False, 0)
    off = simulate(args, args.host_blocks, False, 0)
    unjoined = simulate(args, args.host_blocks, True, 0)
    joined = simulate(args, args.host_blocks, True, 1000)
    assert none["loads"] == 0 and off["loads"] > 0 and off["joined"] == 0
    assert unjoined["loads"] > 0 and unjoined["joined"] == 0
    assert joined["loads"] > 0 and 0 < joined["joined"] <= joined["loads"]
    assert all(t > 0 for t in none["by_turn"] + off["by_turn"] + joined["by_turn"])
    assert off["loaded_blocks"] > 0 and off["later"] < none["later"]  # loads beat recomputing
