"""A cache server and its remote tier (Redis over TCP) behind a slow loopback: run inside a
private network namespace.

``python -m testbed.chaos.netem_run --chunks N`` runs in a network namespace of its own
(``unshare --net``, made by :func:`wrapper`, whose loopback is up and slowed by
:data:`SHAPES`' first that this kernel has: a ``tc netem`` delay, else a ``tbf`` rate limit):
it starts ``redis-server`` on a loopback TCP port, a cache server whose only tier below L1 is
that Redis (``--tier redis:CAP:redis://127.0.0.1:PORT``, prefetch timeout
:data:`PREFETCH_TIMEOUT_S`), stores ``N`` chunks through a probe (``testbed.chaos.probes``),
drops them from L1, looks them up (they cannot arrive in time: a miss with cause
``prefetch_timeout``), waits until every one is promoted, and reads back what then hits, byte
for byte. It prints one JSON line: the first lookup's outcome, the hits, wrong bytes, the
server's counts and exit code, the loopback's qdisc.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from server.launch import ServerProcess
from testbed.chaos.probes import BYTES_PER_TOKEN, ProbeClient, chunk_hashes
from testbed.chaos.tier_faults import read_back, settled, tier_after
from testbed.core import protocol as p
from testbed.core.process_groups import start_group, stop_group
from testbed.core.rpc import RpcClient

CHUNK_SIZE = 64
SHAPES: tuple[tuple[str, str], ...] = (
    ("netem delay 20ms", "tc qdisc add dev lo root netem delay 20ms"),
    (
        "tbf rate 1mbit (this kernel has no netem)",
        "ip link set lo mtu 1500 && tc qdisc add dev lo root tbf rate 1mbit burst 1600 latency 2s",
    ),
)
"""How the loopback is slowed: (what, shell), the first this kernel has."""
PREFETCH_TIMEOUT_S = 0.03
"""Below the least time a read of the chunks takes on the slowed loopback (netem: a round trip
is at least 40 ms; tbf: 8 KiB objects at 1 Mbit/s, 65 ms each past its 1,600-byte burst),
so that the first lookup cannot be answered whole in time whatever the machine's load; an
unslowed loopback reads them in far less."""
_READY_S = 30.0


@functools.cache
def shape() -> tuple[str, str] | str:
    """The first of :data:`SHAPES` a private network namespace here can have, or why none."""
    if sys.platform != "linux" or shutil.which("unshare") is None or shutil.which("tc") is None:
        return "needs Linux with unshare(1) and tc(8) (iproute2)"
    errors = []
    for what, script in SHAPES:
        try:
            done = subprocess.run(
                ["unshare", "--net", "sh", "-c", f"ip link set lo up && {script}"],
                capture_output=True,
                text=True,
                timeout=30,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"unshare --net failed: {exc}"
        if done.returncode == 0:
            return what, script
        errors.append((done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"])
    return f"cannot slow a private loopback here (root and tc netem or tbf needed): {errors}"


def wrapper(script: str) -> list[str]:
    """A command prefix that runs the rest of its arguments in a private network namespace
    whose loopback is up and slowed by ``script``."""
    return ["unshare", "--net", "sh", "-c", f'ip link set lo up && {script} && exec "$0" "$@"']


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbed.chaos.netem_run")
    parser.add_argument("--chunks", type=int, default=8)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvtb-netem-") as directory:
        port = _free_port()
        redis = _start_redis(Path(directory), port)
        try:
            print(json.dumps(_probe_run(port, args.chunks)))
        finally:
            stop_group(redis, 10.0)
    return 0


def _probe_run(port: int, chunks: int) -> dict[str, Any]:
    nbytes = 4 * chunks * CHUNK_SIZE * BYTES_PER_TOKEN
    server = ServerProcess(
        [
            "--chunk-size",
            str(CHUNK_SIZE),
            "--capacity",
            str(nbytes),
            "--tier",
            f"redis:{nbytes}:redis://127.0.0.1:{port}",
            "--prefetch",
            "timeout:0.01",
            "--lookup-pending-timeout",
            "30",
        ]  # fmt: skip
    ).start()
    try:
        with ProbeClient(server.url, server.token, timeout_s=10.0) as probe:
            probe.register()
            hashes = chunk_hashes("netem", chunks)
            probe.store("store", hashes)
            written = tier_after(probe, lambda t: t.writes + t.failures >= chunks)
            with RpcClient(server.url, role="chaos-admin", token=server.admin_token) as admin:
                admin.call(p.DropObjects(chunk_hashes=hashes))
            late = settled(probe, "late", hashes)
            probe.free_locks("late")
            probe.end_session("late")
            promoted = tier_after(probe, lambda t: t.promotions >= chunks)
            hit, errors = read_back(probe, "later", hashes)
            stats = probe.stats()
    finally:
        server.close()
    code = None if server.process is None else server.process.returncode
    return {
        "writes": written.writes,
        "promotions": promoted.promotions,
        "first_miss_status": late.miss_status,
        "first_hit_chunks": late.hit_chunks,
        "prefetch_timeouts": stats.prefetch_timeouts,
        "later_hit_chunks": hit,
        "integrity_errors": errors,
        "tier_failures_by_cause": stats.tiers[0].failures_by_cause,
        "leaked_locks": stats.num_locks,
        "leaked_pins": stats.num_pins,
        "server_exit": code,
        "qdisc": _qdisc(),
    }


def _qdisc() -> str:
    """The loopback's queueing discipline as ``tc`` shows it (the slowing in effect)."""
    done = subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True)
    return done.stdout.strip()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_redis(directory: Path, port: int) -> subprocess.Popen[Any]:
    import redis

    command = [
        "redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(directory),
        "--save", "", "--appendonly", "no", "--loglevel", "warning",
    ]  # fmt: skip
    process = start_group(command, die_with_parent=True, stdout=subprocess.DEVNULL)
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1.0)
    deadline = time.monotonic() + _READY_S
    try:
        while time.monotonic() < deadline and process.poll() is None:
            try:
                if client.ping():
                    return process
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                time.sleep(0.02)
    finally:
        client.close()
    stop_group(process, 10.0)
    raise RuntimeError(f"redis-server on port {port} gave no answer")


if __name__ == "__main__":
    raise SystemExit(main())
