"""Fuzzing a running cache server with :mod:`testbed.chaos.frames`, and checking it after.

Runs in the chaos process (and in the test suite). :func:`send_cases` sends cases over one
DEALER socket (without ``ZMQ_ROUTING_ID``: the server gives connections their ids), a window
at a time, and checks that every case got exactly one decodable reply, that every case that
must be refused was (an ``Error``), and that nothing sent without a credential was accepted.

:func:`fuzz_server` is the whole check against a server started with
:meth:`FuzzSetup.server_args`: another client (the *victim*) first holds a lock group, a pin,
a reservation and stored data, and the fuzzer knows its session ids, op ids and handle; after
the fuzz the victim finishes all of it and finds its data intact, a fresh client does a
normal store, lookup and retrieve with every byte checked, a frame too large to answer
costs only its connection, and once every client has gone (the fuzzer is reaped after the
server's client timeout) the server holds nothing.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import islice

import msgspec
import zmq

from server.launch import ServerProcess
from testbed.chaos.bystander import OpenOperations
from testbed.chaos.frames import FrameFuzzer, FuzzCase, FuzzContext
from testbed.chaos.probes import ProbeClient, chunk_hashes
from testbed.chaos.watch import Held
from testbed.core import protocol as p
from testbed.core.rpc import RemoteError, ServerUnavailable

_MAX_EXAMPLES = 10


@dataclass
class FuzzStats:
    frames: int = 0
    """Messages sent (each must get one reply)."""
    answered: int = 0
    undecodable_replies: int = 0
    violations: int = 0
    """Cases that had to be refused but got a reply that is not an ``Error``."""
    unauthorized_accepted: int = 0
    """Cases without a valid credential that got anything but an ``Error`` (or a ``Pong``)."""
    server_died: bool = False
    wall_s: float = 0.0
    examples: list[str] = field(default_factory=list)
    kinds: Counter[str] = field(default_factory=Counter)
    replies: Counter[str] = field(default_factory=Counter)

    @property
    def unanswered(self) -> int:
        return self.frames - self.answered

    def note(self, text: str) -> None:
        if len(self.examples) < _MAX_EXAMPLES:
            self.examples.append(text)


def send_cases(
    url: str,
    cases: Iterable[FuzzCase],
    *,
    alive: Callable[[], bool],
    window: int = 64,
    reply_timeout_s: float = 5.0,
) -> FuzzStats:
    """Sends ``cases`` and checks their replies; stops early if ``alive()`` turns False."""
    stats = FuzzStats()
    started = time.perf_counter()
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(url)
    by_rid: dict[int, FuzzCase] = {}
    try:
        iterator = iter(cases)
        while batch := list(islice(iterator, window)):
            for case in batch:
                socket.send_multipart(list(case.frames))
                stats.frames += 1
                stats.kinds[case.kind] += 1
                if case.rid:
                    by_rid[case.rid] = case
            if not _collect(socket, stats, by_rid, reply_timeout_s) and not alive():
                stats.server_died = True
                break
        if not stats.server_died:
            _collect(socket, stats, by_rid, reply_timeout_s)
    finally:
        socket.close(0)
        context.term()
    stats.wall_s = time.perf_counter() - started
    return stats


def _collect(
    socket: zmq.Socket, stats: FuzzStats, by_rid: dict[int, FuzzCase], timeout_s: float
) -> bool:
    """Receives replies until every case sent so far is answered (True) or none came for
    ``timeout_s`` (False)."""
    while stats.answered < stats.frames:
        if not socket.poll(int(timeout_s * 1e3)):
            return False
        frame = socket.recv()
        try:
            decoded = p.decode_reply(frame)
        except (msgspec.DecodeError, msgspec.ValidationError):
            stats.answered += 1
            stats.undecodable_replies += 1
            stats.note(f"undecodable reply {frame[:40]!r}")
            continue
        # replies ready together come as one frame (a request that waited, then those behind it)
        replies = decoded.replies if isinstance(decoded, p.Replies) else [decoded]
        stats.answered += len(replies)
        for reply in replies:
            _check_reply(stats, by_rid, reply)
    return True


def _check_reply(stats: FuzzStats, by_rid: dict[int, FuzzCase], reply: p.Reply) -> None:
    """Counts one reply and checks it against the case it answers."""
    is_error = isinstance(reply, p.Error)
    stats.replies[f"error:{reply.code}" if isinstance(reply, p.Error) else p.op_name(reply)] += 1
    case = by_rid.pop(reply.rid, None) if reply.rid else None
    if case is None or is_error:
        return
    if case.expect_error:
        stats.violations += 1
        stats.note(f"case {case.index} ({case.kind} {case.op}) was answered {reply!r}")
    if case.unauthenticated and not isinstance(reply, p.Pong):
        stats.unauthorized_accepted += 1
        stats.note(f"case {case.index} ({case.op} without credential) got {reply!r}")


# ---------------------------------------------------------------------------------------------
# The whole check
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FuzzSetup:
    """How the fuzzed server runs: short client timeout (the fuzzer is reaped soon after it
    leaves), a 1 MiB frame limit (oversized frames stay cheap)."""

    chunk_size: int = 64
    client_timeout_s: float = 1.5
    max_message_bytes: int = 1 << 20
    max_chunks_per_request: int = 256

    def server_args(self) -> list[str]:
        return [
            "--chunk-size", str(self.chunk_size),
            "--capacity", "64MiB",
            "--client-timeout", str(self.client_timeout_s),
            "--op-ttl", "120",
            "--max-message-bytes", str(self.max_message_bytes),
            "--max-chunks-per-request", str(self.max_chunks_per_request),
        ]  # fmt: skip


@dataclass
class FuzzReport:
    stats: FuzzStats
    victim_problems: list[str]
    """What the fuzzer changed of the other client's operations and data (empty: nothing)."""
    probe_integrity_errors: int
    """A normal store/lookup/retrieve after the fuzz: chunks that missed or came back wrong."""
    oversized_connection_dropped: bool
    """A frame over twice the limit: no reply, connection dropped, the server serves on."""
    held_after: Held | None
    """What the server held once every client had gone (``None``: it did not answer)."""
    fuzzer_reaped: bool
    server_alive: bool

    @property
    def crashed(self) -> bool:
        return self.stats.server_died or not self.server_alive

    @property
    def ok(self) -> bool:
        return (
            not self.crashed
            and self.stats.unanswered == 0
            and self.stats.undecodable_replies == 0
            and self.stats.violations == 0
            and self.stats.unauthorized_accepted == 0
            and not self.victim_problems
            and self.probe_integrity_errors == 0
            and self.oversized_connection_dropped
            and self.held_after is not None
            and self.held_after.quiescent
            and self.fuzzer_reaped
        )


_VICTIM = "victim"
_VICTIM_OPS = (900_001, 900_002)


def fuzz_server(
    server: ServerProcess, setup: FuzzSetup, *, num_frames: int, seed: int
) -> FuzzReport:
    """Fuzzes ``server`` (started with ``setup.server_args()``) with ``num_frames`` cases."""

    def alive() -> bool:
        return server.process is not None and server.process.poll() is None

    stored, reserved = chunk_hashes(f"{_VICTIM}/stored", 4), chunk_hashes(f"{_VICTIM}/new", 3)
    with ProbeClient(server.url, server.token, model=_VICTIM, heartbeat_interval_s=0.3) as victim:
        victim.register()
        victim_ops = OpenOperations.open(
            victim, _VICTIM, stored, reserved,
            pinned=2, retrieve_op=_VICTIM_OPS[0], store_op=_VICTIM_OPS[1],
        )  # fmt: skip
        context = FuzzContext(
            token=server.token,
            epoch=victim.epoch,
            foreign_sessions=victim_ops.sessions,
            foreign_op_ids=_VICTIM_OPS,
            foreign_handles=(victim_ops.found.handle,),
            chunk_hashes=tuple(stored + reserved),
            models=(_VICTIM,),
            max_message_bytes=setup.max_message_bytes,
        )
        cases = FrameFuzzer(seed, context).cases(num_frames)
        stats = send_cases(server.url, cases, alive=alive)
        problems: list[str] = []
        if alive():
            try:
                for problem in victim_ops.finish():
                    problems.append(problem)
            except (RemoteError, ServerUnavailable) as exc:
                problems.append(f"the victim's own requests failed: {exc}")
    dropped = alive() and _oversized_drops_connection(server.url, setup.max_message_bytes)
    probe_errors = 0
    if alive():
        with ProbeClient(server.url, server.token, model="after-fuzz") as probe:
            probe.register()
            probe_errors = probe.cycle(f"after-fuzz-{seed}")
    held, reaped = None, False
    if alive():
        with ProbeClient(server.url, server.token, model="checker") as checker:
            deadline = time.monotonic() + setup.client_timeout_s + 3.0
            while True:
                after = checker.stats()
                held, reaped = Held.of(after), after.num_clients == 1  # only the checker
                if (held.quiescent and reaped) or time.monotonic() >= deadline:
                    break
                time.sleep(0.1)
    return FuzzReport(stats, problems, probe_errors, dropped, held, reaped, alive())


def _oversized_drops_connection(url: str, max_message_bytes: int) -> bool:
    """A frame over twice the limit gets no reply (ZeroMQ drops that connection); the
    server goes on answering others."""
    context = zmq.Context()
    try:
        big = context.socket(zmq.DEALER)
        big.setsockopt(zmq.LINGER, 0)
        big.connect(url)
        big.send(b"\x81\xa2op" + b"\x00" * (2 * max_message_bytes + 1))
        answered = bool(big.poll(1000))
        big.close(0)
        ping = context.socket(zmq.DEALER)
        ping.setsockopt(zmq.LINGER, 0)
        ping.connect(url)
        ping.send(p.encode(p.Ping(rid=1)))
        pong = ping.poll(5000) and isinstance(p.decode_reply(ping.recv()), p.Pong)
        ping.close(0)
        return not answered and bool(pong)
    finally:
        context.term()
