"""The cache server process: a ZeroMQ ROUTER loop around :class:`server.service.CacheService`.

``python -m server`` / ``kvtb server``. Binds loopback by default and prints one readiness
line on stdout, ``KVTB_SERVER_READY endpoint=tcp://HOST:PORT pid=PID``, once it accepts
requests (so launchers can start it with ``--port 0``). Malformed, oversized or unknown frames
get an ``Error`` reply; nothing a client sends can stop the loop. SIGTERM/SIGINT stop it
cleanly: spans are flushed and the shared-memory pool is removed.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec
import zmq

from server.config import ServerConfig
from server.service import CacheService
from testbed import protocol as p
from testbed.sizes import parse_bytes
from testbed.telemetry import attributes as a
from testbed.telemetry.setup import TracingConfig, configure_tracing

log = logging.getLogger("server")

READY_PREFIX = "KVTB_SERVER_READY"
_MAX_BATCH = 256  # requests handled per poll wake-up before TTLs are checked again


def serve(
    config: ServerConfig,
    *,
    on_ready: Callable[[str], None],
    stop: threading.Event,
    parent_pid: int | None = None,
) -> None:
    """Serves until ``stop`` is set (or, with ``parent_pid``, until that parent is gone).
    ``on_ready`` gets the bound endpoint."""
    with CacheService(config) as service, zmq.Context() as context:
        socket = context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, 2 * config.max_message_bytes)
        try:
            port = _bind(socket, config)
            on_ready(f"tcp://{config.host}:{port}")
            _loop(socket, service, config, stop, parent_pid)
        finally:
            socket.close()


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
    parent_pid: int | None = None,
) -> None:
    poller = zmq.Poller()
    poller.register(socket, zmq.POLLIN)
    next_tick = time.monotonic() + config.reap_interval_s
    while not stop.is_set():
        timeout_ms = max(0.0, next_tick - time.monotonic()) * 1e3
        if poller.poll(int(min(timeout_ms, 100.0))):
            for _ in range(_MAX_BATCH):
                try:
                    frames = socket.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                identity, reply = handle_frames(service, frames, config.max_message_bytes)
                socket.send_multipart([identity, p.encode(reply)])
        if time.monotonic() >= next_tick:
            service.tick()
            next_tick = time.monotonic() + config.reap_interval_s
            if parent_pid is not None and os.getppid() != parent_pid:
                log.warning("the process that started this server is gone; stopping")
                stop.set()


def handle_frames(
    service: CacheService, frames: list[bytes], max_bytes: int
) -> tuple[bytes, p.Reply]:
    """Identity and reply for one ROUTER message; every malformed input gets an Error."""
    identity = frames[0]
    body = frames[1:]
    if len(body) != 1:
        return identity, service.error(
            0, "malformed", f"expected exactly one frame per request, got {len(body)}"
        )
    frame = body[0]
    if len(frame) > max_bytes:
        return identity, service.error(
            0, "too_large", f"request of {len(frame)} bytes exceeds the limit of {max_bytes}"
        )
    try:
        request = p.decode_request(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return identity, service.error(0, "malformed", f"cannot decode request: {exc}"[:500])
    return identity, service.handle(identity, request)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(
        prog="kvtb server", description=__doc__.split("\n")[0]
    )
    d = ServerConfig()
    parser.add_argument("--host", default=d.host, help="interface to bind (default: %(default)s)")
    parser.add_argument(
        "--port",
        type=int,
        default=d.port,
        help="TCP port; 0 picks a free one (default: %(default)s)",
    )
    parser.add_argument(
        "--chunk-size",
        type=int,
        default=d.chunk_size,
        help="tokens per chunk (default: %(default)s)",
    )
    parser.add_argument(
        "--capacity",
        default=str(d.capacity_bytes),
        help="capacity in bytes, e.g. 512MiB (default: 1GiB)",
    )
    parser.add_argument(
        "--metadata-only", action="store_true", help="account sizes only; no pool, no copies"
    )
    parser.add_argument(
        "--policy", default=d.policy, help="eviction policy: lru, fifo, lfu (default: %(default)s)"
    )
    parser.add_argument(
        "--read-lock-ttl",
        type=float,
        default=d.read_lock_ttl_s,
        help="seconds (default: %(default)s)",
    )
    parser.add_argument(
        "--session-ttl", type=float, default=d.session_ttl_s, help="seconds (default: %(default)s)"
    )
    parser.add_argument(
        "--client-timeout",
        type=float,
        default=d.client_timeout_s,
        help="seconds without a message before a client is reaped (default: %(default)s)",
    )
    parser.add_argument(
        "--lookup-pending-timeout",
        type=float,
        default=d.lookup_pending_timeout_s,
        help="seconds (default: %(default)s)",
    )
    parser.add_argument(
        "--max-message-bytes",
        default=str(d.max_message_bytes),
        help="largest accepted frame (default: 64MiB)",
    )
    parser.add_argument(
        "--log-level", default="WARNING", help="logging level (default: %(default)s)"
    )
    parser.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="stop when the process that started the server exits (launchers use this)",
    )
    tracing = parser.add_argument_group("tracing")
    tracing.add_argument(
        "--run-dir", type=Path, help="write spans to RUN_DIR/spans/ (OTLP JSON lines)"
    )
    tracing.add_argument("--run-id", default="", help="kvcache.run_id resource attribute")
    tracing.add_argument(
        "--otlp-endpoint", help="also export spans over OTLP (e.g. http://localhost:4317)"
    )
    tracing.add_argument(
        "--otlp-protocol",
        choices=["grpc", "http/protobuf"],
        help="default: grpc, or OTEL_EXPORTER_OTLP_PROTOCOL",
    )
    return parser


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        host=args.host,
        port=args.port,
        chunk_size=args.chunk_size,
        capacity_bytes=parse_bytes(args.capacity),
        metadata_only=args.metadata_only,
        policy=args.policy,
        read_lock_ttl_s=args.read_lock_ttl,
        session_ttl_s=args.session_ttl,
        client_timeout_s=args.client_timeout,
        lookup_pending_timeout_s=args.lookup_pending_timeout,
        max_message_bytes=parse_bytes(args.max_message_bytes),
    )


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
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    def announce(endpoint: str) -> None:
        print(f"{READY_PREFIX} endpoint={endpoint} pid={os.getpid()}", flush=True)

    tracing = configure_tracing(
        TracingConfig(
            service_name="kvtb-server",
            run_dir=args.run_dir,
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
        print(f"kvtb server: cannot bind {config.host}:{config.port}: {exc}", file=sys.stderr)
        return 1
    finally:
        if tracing is not None:
            tracing.shutdown()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))
