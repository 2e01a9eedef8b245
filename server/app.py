"""The cache server process: a ZeroMQ ROUTER loop around :class:`server.service.CacheService`.

``python -m server`` / ``kvtb server``. Binds loopback by default and prints one readiness
line on stdout once it accepts requests (so launchers can start it with ``--port 0``)::

    KVTB_SERVER_READY endpoint=tcp://HOST:PORT pid=PID epoch=N token_file=PATH prefault_ms=X
        pool_medium=shm    (one line; ``none`` with ``--metadata-only``)

Its pool's memory is reserved before that line (``server.pool``): a pool that does not fit is
refused at start (exit code 2, naming its size and what is free). Nothing a client sends can
stop the loop: a frame that cannot be decoded (malformed, oversized, nested, an unknown op)
gets an ``Error`` reply; frames larger than twice
``--max-message-bytes`` make ZeroMQ drop the connection. Clients are known by the routing id
ZeroMQ gives their connection (unique per connection for the server's life); a client that
chose its own routing id (``ZMQ_ROUTING_ID``) could reuse another's after it left, so its
requests are refused. A client silent past ``--client-timeout`` is reaped: everything it owned
is released; a connection that sends no authenticated request soon is closed
(``server.connections``). SIGTERM, SIGINT and SIGHUP stop the server cleanly: spans and the
chunk log are flushed, the pool and its token file removed; files of earlier servers that
were killed are reclaimed at start. A full disk costs spans and chunk log rows (counted and
logged), never the service.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import zmq

from server.auth import Credentials, hold_token_file, server_credentials, start_curve
from server.chunk_log import ChunkLog
from server.config import ServerConfig
from server.connections import (
    ConnectionGuard,
    default_max_unauthenticated,
    descriptor_limit,
    source_fd,
)
from server.flags import add_config_arguments, config_from_args
from server.metrics_bridge import StatsBridge
from server.reclaim import default_token_path, reclaim_dead_server_files
from server.service import CacheService
from testbed.core import protocol as p
from testbed.core.telemetry import attributes as a
from testbed.core.telemetry.setup import TracingConfig, add_otlp_arguments, configure_tracing

if TYPE_CHECKING:
    from server.metrics import MetricsEndpoint

log = logging.getLogger("server")

READY_PREFIX = "KVTB_SERVER_READY"
_MAX_BATCH = 256  # requests handled per poll wake-up before slices and TTLs run again
Reply = tuple[bytes, p.Reply]
_TIER_POLL_MS = 1.0  # how soon finished tier I/O is collected while some is in flight


def serve(
    config: ServerConfig,
    *,
    on_ready: Callable[[dict[str, str]], None],
    stop: threading.Event,
    parent_pid: int | None = None,
) -> None:
    """Serves until ``stop`` is set (or, with ``parent_pid``, until that parent is gone).
    ``on_ready`` gets the readiness fields (endpoint, pid, epoch, token_file, prefault_ms,
    pool_medium)."""
    reclaimed = reclaim_dead_server_files()
    if reclaimed:
        log.warning("removed %d files of servers that no longer run", len(reclaimed))
    token_path = config.token_file or default_token_path()
    credentials = server_credentials(config.token_file)
    with zmq.Context() as context:
        socket = _router(context, config)
        authenticator = start_curve(context, socket, config.curve_dir)
        try:
            port = _bind(socket, config)
            with hold_token_file(token_path, credentials, keep=config.token_file is not None):
                _serve_bound(
                    config, credentials, socket, port, token_path, on_ready, stop, parent_pid
                )
        finally:
            socket.close()
            if authenticator is not None:
                authenticator.stop()


def _serve_bound(
    config: ServerConfig,
    credentials: Credentials,
    socket: zmq.Socket,
    port: int,
    token_path: Path,
    on_ready: Callable[[dict[str, str]], None],
    stop: threading.Event,
    parent_pid: int | None,
) -> None:
    chunk_log = None
    if config.run_dir is not None and not config.no_chunk_log:
        chunk_log = ChunkLog(config.run_dir)
    guard = ConnectionGuard(
        socket,
        auth_timeout_s=config.auth_timeout_s,
        max_unauthenticated=config.max_unauthenticated
        or default_max_unauthenticated(descriptor_limit()),
    )
    bridge = StatsBridge()
    try:
        with (
            CacheService(config, credentials, chunk_log=chunk_log) as service,
            _metrics_endpoint(config, bridge) as metrics,
        ):
            prefault_s = 0.0
            if service.pool is not None and service.pool.size <= config.prefault_bytes:
                prefault_s = service.pool.prefault()
            fields = {
                "endpoint": f"tcp://{config.host}:{port}",
                "pid": str(os.getpid()),
                "epoch": str(service.epoch),
                "token_file": str(token_path),
                "prefault_ms": f"{float(prefault_s or 0.0) * 1e3:.1f}",
                "pool_medium": "none" if service.pool is None else service.pool.medium,
            }
            on_ready(fields if metrics is None else {**fields, "metrics": metrics.url})
            _loop(socket, service, config, stop, parent_pid, guard, bridge)
    finally:
        guard.close()


def _metrics_endpoint(
    config: ServerConfig, bridge: StatsBridge
) -> AbstractContextManager[MetricsEndpoint | None]:
    """The Prometheus endpoint of ``--metrics-port`` (``server.metrics``), or none."""
    if config.metrics_port is None:
        return nullcontext()
    from server.metrics import MetricsEndpoint

    return MetricsEndpoint(config.host, config.metrics_port, bridge)


def _router(context: zmq.Context, config: ServerConfig) -> zmq.Socket:
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.MAXMSGSIZE, 2 * config.max_message_bytes)
    return socket


def _bind(socket: zmq.Socket, config: ServerConfig) -> int:
    if config.port == 0:
        return socket.bind_to_random_port(f"tcp://{config.host}")
    socket.bind(f"tcp://{config.host}:{config.port}")
    return config.port


def _loop(
    socket: zmq.Socket,
    service: CacheService,
    config: ServerConfig,
    stop: threading.Event,
    parent_pid: int | None,
    guard: ConnectionGuard,
    bridge: StatsBridge,
) -> None:
    poller = zmq.Poller()
    poller.register(socket, zmq.POLLIN)
    poller.register(guard.monitor, zmq.POLLIN)
    next_tick = time.monotonic() + config.reap_interval_s
    while not stop.is_set():
        timeout_ms = 0.0 if service.busy else max(0.0, next_tick - time.monotonic()) * 1e3
        if service.tiers_busy:
            timeout_ms = min(timeout_ms, _TIER_POLL_MS)
            service.pump()
        ready = dict(poller.poll(int(min(timeout_ms, 100.0))))
        if guard.monitor in ready:
            guard.read_events()
        if socket in ready:
            for _ in range(_MAX_BATCH):
                try:
                    frames = socket.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                received_ns = time.monotonic_ns()
                replies, authenticated = handle_frames(
                    service,
                    [frame.bytes for frame in frames],
                    config.max_message_bytes,
                    received_ns,
                )
                if authenticated:
                    guard.authenticated(source_fd(frames[-1]))
                _send(socket, service, replies)
        if service.busy:
            _send(socket, service, service.advance())
        bridge.answer(service.stats)
        if time.monotonic() >= next_tick:
            service.tick()
            guard.tick()
            service.counters.unauthenticated_closed = guard.closed
            next_tick = time.monotonic() + config.reap_interval_s
            if parent_pid is not None and os.getppid() != parent_pid:
                log.warning("the process that started this server is gone; stopping")
                stop.set()


def _send(socket: zmq.Socket, service: CacheService, replies: list[Reply]) -> None:
    """Sends ``replies``; consecutive ones to the same client go as one ``Replies`` frame.
    Each is stamped with the time it is sent (``replied_ns``)."""
    for identity, group in itertools.groupby(replies, key=lambda reply: reply[0]):
        ready = [reply for _, reply in group]
        sent_ns = time.monotonic_ns()
        for reply in ready:
            reply.replied_ns = sent_ns
        message = ready[0] if len(ready) == 1 else p.Replies(replies=ready, epoch=service.epoch)
        try:
            socket.send_multipart([identity, p.encode(message)], zmq.NOBLOCK)
        except zmq.ZMQError:  # the peer's queue is full or it went away
            service.counters.dropped_frames += len(ready)  # every reply it carried


def handle_frames(
    service: CacheService, frames: list[bytes], max_bytes: int, received_ns: int = 0
) -> tuple[list[Reply], bool]:
    """Replies for one ROUTER message (every malformed input gets an Error; never raises), and
    whether the message was a request with a valid credential (``received_ns``: when it was
    read, stamped on its replies)."""
    identity = frames[0]
    body = frames[1:]
    if not identity.startswith(b"\x00"):
        # ZeroMQ's own routing ids start with a zero byte, which applications may not use.
        message = (
            "clients must not set ZMQ_ROUTING_ID: connections are identified by the routing id "
            "the server gives them, so that no client can take over another's"
        )
        return [(identity, service.forbidden(message))], False
    if len(body) != 1:
        message = f"expected one frame per request, got {len(body)}"
        return [(identity, service.error(0, "malformed", message))], False
    frame = body[0]
    if len(frame) > max_bytes:
        message = f"request of {len(frame)} bytes exceeds the limit of {max_bytes}"
        return [(identity, service.error(0, "too_large", message))], False
    try:
        request = p.decode_request(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        message = f"cannot decode request: {exc}"[:500]
        return [(identity, service.error(0, "malformed", message))], False
    except Exception as exc:  # RecursionError, MemoryError, ...: never fatal
        message = f"cannot decode request: {type(exc).__name__}"
        return [(identity, service.error(0, "malformed", message))], False
    authenticated = not isinstance(request, p.Ping) and service.credentials.is_client(request.auth)
    try:
        replies = service.handle(identity, request, received_ns)
    except Exception as exc:  # handle() never raises; this is the last line of defence
        log.exception("unexpected error handling a request")
        replies = [(identity, service.error(request.rid, "internal", f"{type(exc).__name__}"))]
    return replies, authenticated


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """``kvtb server``'s flags: one per :class:`ServerConfig` field (``server.flags``), and
    the process's own (logging, its parent, telemetry)."""
    parser = parser or argparse.ArgumentParser(
        prog="kvtb server", description=__doc__.split("\n")[0]
    )
    add_config_arguments(parser)
    parser.add_argument(
        "--log-level", default="WARNING", help="logging level (default: %(default)s)"
    )
    parser.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="stop when the process that started the server exits (launchers use this)",
    )
    tracing = parser.add_argument_group("telemetry")
    tracing.add_argument("--run-id", default="", help="kvcache.run_id resource attribute")
    add_otlp_arguments(tracing)
    return parser


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s server %(levelname)s %(message)s"
    )
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"kvtb server: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())

    def announce(fields: dict[str, str]) -> None:
        line = " ".join(f"{key}={value}" for key, value in fields.items())
        print(f"{READY_PREFIX} {line}", flush=True)

    tracing = configure_tracing(
        TracingConfig(
            service_name="kvtb-server",
            run_dir=config.run_dir,
            run_id=args.run_id,
            resource={
                a.CHUNK_SIZE: config.chunk_size,
                a.CAPACITY_BYTES: config.capacity_bytes,
                a.POLICY: config.policy,
            },
            otlp_endpoint=args.otlp_endpoint,
            otlp_protocol=args.otlp_protocol,
        )
    )
    try:
        parent = os.getppid() if args.exit_with_parent else None
        serve(config, on_ready=announce, stop=stop, parent_pid=parent)
    except zmq.ZMQError as exc:
        hint = " (is another server using that port? pick another with --port, or 0)"
        in_use = exc.errno == zmq.EADDRINUSE
        print(
            f"kvtb server: cannot bind {config.host}:{config.port}: {exc}{hint if in_use else ''}",
            file=sys.stderr,
        )
        return 1
    except (ValueError, OSError) as exc:
        print(f"kvtb server: {exc}", file=sys.stderr)
        return 2
    finally:
        if tracing is not None:
            tracing.shutdown()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))
