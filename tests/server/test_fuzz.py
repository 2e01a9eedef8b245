"""Structure-aware fuzzing: no frame stops the server, every frame is answered, nothing leaks.

The fuzzer (``testbed.chaos.frames``) makes valid requests of every type from the protocol's
own structs and mutates them; ``testbed.chaos.fuzz`` sends them to a real server while
another client holds a lock group, a pin and a reservation, then checks that client's state,
a normal store/lookup/retrieve and, once the fuzzer is gone, that nothing is held.
"""

from __future__ import annotations

import random

import msgspec
import pytest
import zmq

from testbed.chaos.frame_edits import encode_map, nested
from testbed.chaos.frames import REQUEST_OPS, FrameFuzzer, FuzzContext
from testbed.chaos.fuzz import FuzzSetup, fuzz_server
from testbed.core import protocol as p

FRAMES = 10_000
SEED = 8

CONTEXT = FuzzContext(
    token="t" * 48,
    epoch=12345,
    foreign_sessions=("victim:1",),
    foreign_op_ids=(900_001,),
    foreign_handles=(b"h" * 16,),
)


def test_ten_thousand_fuzz_frames_are_all_answered_and_the_server_stays_correct(start_server):
    setup = FuzzSetup()
    server = start_server(*setup.server_args())
    report = fuzz_server(server, setup, num_frames=FRAMES, seed=SEED)
    stats = report.stats
    assert stats.frames == FRAMES
    assert not report.crashed
    assert stats.unanswered == 0
    assert stats.undecodable_replies == 0
    assert stats.violations == 0, stats.examples
    assert stats.unauthorized_accepted == 0, stats.examples
    assert report.victim_problems == []
    assert report.probe_integrity_errors == 0
    assert report.oversized_connection_dropped
    assert report.held_after is not None and report.held_after.quiescent
    assert report.held_after.sessions == 0
    assert report.fuzzer_reaped
    assert set(stats.kinds) == {
        "valid", "bad_auth", "version", "wrong_type", "out_of_range", "missing_field",
        "unknown_field", "unknown_op", "op_not_first", "huge_length", "truncated",
        "trailing_bytes", "bit_flip", "deep_nesting", "not_a_map", "multi_frame",
        "empty_frame", "oversized",
    }  # fmt: skip
    # Valid requests reached the handlers, not only the decoder.
    for reply in ("store_plan", "retrieve_plan", "lookup_result", "registered", "stats"):
        assert stats.replies[reply] > 0, reply


def test_the_frames_are_deterministic_by_seed():
    first = [case.frames for case in FrameFuzzer(SEED, CONTEXT).cases(500)]
    again = [case.frames for case in FrameFuzzer(SEED, CONTEXT).cases(500)]
    other = [case.frames for case in FrameFuzzer(SEED + 1, CONTEXT).cases(500)]
    assert first == again
    assert first != other


def test_every_case_that_must_be_refused_cannot_be_decoded_or_is_refused_by_rule():
    """The fuzzer's expectations agree with the protocol's decoder: a case marked
    ``expect_error`` either does not decode, or carries a wrong version or credential."""
    for case in FrameFuzzer(SEED, CONTEXT).cases(4000):
        if not case.expect_error or case.unauthenticated:
            continue
        if len(case.frames) != 1 or len(case.frames[0]) > CONTEXT.max_message_bytes:
            continue
        try:
            request = p.decode_request(case.frames[0])
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
        assert request.v != p.PROTOCOL_VERSION, (case.kind, case.op, request)


def test_valid_cases_of_every_request_type_decode():
    fuzzer = FrameFuzzer(SEED, CONTEXT)
    for op in REQUEST_OPS:
        for index in range(20):
            case = fuzzer.case(index, kind="valid", op=op)
            request = p.decode_request(case.frames[0])
            assert p.op_name(request) == op
            assert request.rid == case.rid


@pytest.mark.parametrize("depth", [1_009, 100_000])
def test_deeply_nested_frames_get_an_error_and_the_server_answers_on(server, depth):
    """The ~1,009-byte nested frame that once killed the server, as a field and as a frame."""
    rng = random.Random(depth)
    frames = [
        nested(depth, rng),
        encode_map([("op", "lookup"), ("session_id", msgspec.Raw(nested(depth, rng)))]),
        encode_map([("op", msgspec.Raw(nested(depth, rng)))]),
    ]
    context = zmq.Context.instance()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(server.url)
    try:
        for frame in frames:
            socket.send(frame)
            assert socket.poll(5000)
            reply = p.decode_reply(socket.recv())
            assert isinstance(reply, p.Error) and reply.code == "malformed"
        socket.send(p.encode(p.Ping(rid=7)))
        assert socket.poll(5000)
        assert isinstance(p.decode_reply(socket.recv()), p.Pong)
    finally:
        socket.close()
    assert server.process.poll() is None
