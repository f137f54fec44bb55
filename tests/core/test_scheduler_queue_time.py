"""EngineCoreOutput.queue_time: a request's first output says how long it waited from arrival
to its first scheduling; later outputs leave it out."""

import time

import msgspec

from echo.core.request import Request
from echo.core.step_results import EngineCoreOutput
from echo.sampling_params import SamplingParams
from tests.core.scheduler_helpers import EOS, make_runner, make_scheduler, step


def test_first_output_carries_the_wait_from_arrival_to_first_scheduling():
    sched = make_scheduler(max_num_seqs=1)  # one seat: the second request waits for it
    runner = make_runner(sched)
    arrival = time.time() - 5.0
    first = Request("a", [1000 + i for i in range(8)], SamplingParams(max_tokens=3),
                    eos_token_ids=(EOS,), arrival_time=arrival)
    second = Request("b", [2000 + i for i in range(8)], SamplingParams(max_tokens=2),
                     eos_token_ids=(EOS,), arrival_time=arrival)
    sched.add_request(first)
    sched.add_request(second)
    outputs: dict[str, list[EngineCoreOutput]] = {"a": [], "b": []}
    scheduled_by: dict[str, float] = {}  # the test's own clock, after the step that took it
    while sched.has_unfinished_requests():
        _, outs = step(sched, runner)
        for out in outs:
            outputs[out.request_id].append(out)
            scheduled_by.setdefault(out.request_id, time.time())
    assert [len(o.new_token_ids) for o in outputs["a"]] == [1, 1, 1]
    assert [len(o.new_token_ids) for o in outputs["b"]] == [1, 1]
    for request in (first, second):
        outs = outputs[request.request_id]
        # arrival was 5 s before the test began; the first scheduling came before its output
        assert 5.0 <= outs[0].queue_time <= scheduled_by[request.request_id] - arrival
        assert all(o.queue_time is None for o in outs[1:])
    assert outputs["a"][0].queue_time >= 5.0
    # b was admitted only once a finished: it waited longer
    assert second.first_scheduled_time > first.first_scheduled_time
    assert outputs["b"][0].queue_time > outputs["a"][0].queue_time


def test_queue_time_survives_the_wire_and_is_left_out_when_unset():
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(EngineCoreOutput)
    with_time = EngineCoreOutput("r", [1, 2], num_cached_tokens=3, queue_time=0.125)
    assert dec.decode(enc.encode(with_time)) == with_time
    plain = EngineCoreOutput("r", [1])
    assert dec.decode(enc.encode(plain)).queue_time is None
    assert len(enc.encode(plain)) < len(enc.encode(msgspec.structs.replace(plain,
                                                                           queue_time=0.5)))
