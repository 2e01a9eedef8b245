"""A server never dies from a client's mistake; an engine never hangs on a dead server."""

from __future__ import annotations

import random
import time

import msgspec
import zmq

from testbed.core import protocol as p
from tests.support.cache_harness import Harness

C = 64


def prompt(n: int) -> list[int]:
    return [(35_761 * i + 11) % 50_000 for i in range(n)]


def _malformed_frames(rng: random.Random, count: int) -> list[list[bytes]]:
    """Random bytes, truncated and mistyped messages, unknown ops, hostile lengths, extra frames."""
    valid = [
        p.encode(p.Lookup(session_id="s", model="m", world_size=1, chunk_hashes=[b"x" * 16])),
        p.encode(
            p.StoreBegin(
                op_id=1, epoch=1, items=[p.OpItem(session_id="s", chunk_hashes=[b"y" * 16])]
            )
        ),
        p.encode(p.RetrieveEnd(op_id=3, ok=[True])),
        p.encode(p.FreeLocks(session_id="s", end_token=100)),
    ]
    encoder = msgspec.msgpack.Encoder()
    makers = [
        lambda: [rng.randbytes(rng.randint(0, 300))],
        lambda: [(frame := rng.choice(valid))[: rng.randint(0, len(frame) - 1)]],
        lambda: [encoder.encode({"op": "lookup", "session_id": 5, "model": [], "world_size": "x"})],
        lambda: [encoder.encode({"op": rng.choice(["drop_table", "", "LOOKUP", 7])})],
        lambda: [
            encoder.encode(
                {
                    "op": "lookup",
                    "session_id": "s",
                    "model": "m",
                    "world_size": 1,
                    "chunk_hashes": [b"short"],
                }
            )
        ],
        lambda: [encoder.encode({"op": "free_locks", "session_id": "s", "end_token": -5})],
        lambda: [encoder.encode({"op": "ping", "v": 99})],
        lambda: [b"\xdd\xff\xff\xff\xff" + rng.randbytes(8)],  # array32 claiming 4 billion items
        lambda: [b"\xdb\xff\xff\xff\xff" + b"abc"],  # str32 claiming 4 GiB
        lambda: [b"\xc6\x7f\xff\xff\xff"],  # bin32 claiming 2 GiB
        lambda: [rng.choice(valid), rng.choice(valid)],  # two frames in one message
        lambda: [b""],
        lambda: [encoder.encode(rng.choice([None, 1, 2.5, "x", [1, 2], {"v": 1}]))],
        lambda: [encoder.encode({"op": "retrieve_end", "op_id": rng.randint(0, 10**9)})],
        lambda: [encoder.encode({"op": "store_commit", "op_id": rng.randint(0, 10**9)})],
        lambda: [encoder.encode({"op": "lookup_poll", "session_id": "nobody"})],
    ]
    return [rng.choice(makers)() for _ in range(count)]


def test_a_thousand_malformed_frames_get_errors_and_the_server_keeps_serving(start_server):
    server = start_server("--chunk-size", str(C), "--max-message-bytes", "1MiB")
    context = zmq.Context.instance()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(server.url)
    frames = _malformed_frames(random.Random(1234), 1000)
    frames.append([b"\x80" * (2 << 20)])  # 2 MiB: over the 1 MiB limit
    errors = 0
    try:
        for message in frames:
            socket.send_multipart(message)
            if socket.poll(5000):
                reply = p.decode_reply(socket.recv())
                assert isinstance(reply, p.Error), reply
                errors += 1
    finally:
        socket.close()
    assert errors == len(frames)  # none dropped silently, none crashed the server
    assert server.process.poll() is None
    with Harness(server) as h:
        h.prefill("after", prompt(3 * C + 1), list(range(13)))
        assert h.matched("probe", prompt(3 * C + 1)) == 3 * C
        assert h.stats().errors >= len(frames)


def test_a_dead_server_means_misses_and_failed_loads_within_the_timeout(start_server):
    server = start_server("--chunk-size", str(C))
    tokens = prompt(3 * C + 1)
    timeout_s = 1.0
    with Harness(server, timeout_s=timeout_s) as h:
        h.prefill("a", tokens, list(range(13)))
        h.matched("b", tokens)
        plan = h.allocate("b", list(range(20, 33)), 3 * C)
        server.kill()

        started = time.monotonic()
        h.side.lookup_wait_s = 30.0  # would wait this long if the client hung
        assert h.matched("after-death", prompt(4 * C + 1)) == 0
        assert time.monotonic() - started < timeout_s + 1.0

        started = time.monotonic()
        (outcome,) = h.load(plan)
        assert outcome.finished == {"b"}
        assert outcome.failed_block_ids == set(range(20, 32))
        assert time.monotonic() - started < timeout_s + 1.0

        store = h.compute("a2", 0, 0, [], True)  # nothing tracked: empty plan
        assert not store.stores
        h.matched("c", prompt(2 * C + 1))
        h.side.update_state_after_alloc("c", list(range(40, 49)), 0)
        plan = h.compute("c", 0, 2 * C + 1, list(range(40, 49)), True)
        started = time.monotonic()
        assert h.ranks[0].client.store(plan.stores) is False
        assert time.monotonic() - started < timeout_s + 1.0
