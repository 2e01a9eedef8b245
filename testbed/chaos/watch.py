"""Watching cache servers from outside: what they hold, their memory, files they leave.

Runs in the chaos process. :class:`ServerWatch` samples a server's ``GetStats`` and resident
memory on a thread (capacity violations: samples with ``used_bytes > capacity_bytes``);
:func:`wait_quiescent` waits until a server holds no lock, pin, reservation, retrieve or
pending lookup, and says what was still held at its deadline; :func:`leftover_files` lists
the pool and token files of dead servers still on disk (``server.reclaim``'s naming).
"""

from __future__ import annotations

import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from server.reclaim import SERVER_FILE, server_files_dir
from testbed.core import protocol as p
from testbed.core.closing import Closing
from testbed.core.owned_files import is_owned
from testbed.core.quiescence import Quiescence
from testbed.core.rpc import RemoteError, RpcClient, ServerUnavailable


def rss_mib(pid: int) -> float | None:
    """Resident memory of process ``pid`` (``VmRSS``), ``None`` if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


@dataclass(frozen=True)
class Held:
    """What a server still holds: its quiescence record (``testbed.core.quiescence``), and
    its sessions and clients for the report."""

    state: Quiescence
    sessions: int
    clients: int

    @classmethod
    def of(cls, stats: p.ServerStats) -> Held:
        return cls(Quiescence.of(stats), stats.num_sessions, stats.num_clients)

    @property
    def quiescent(self) -> bool:
        return self.state.quiescent

    def leaks(self) -> dict[str, int]:
        """What it held, as a scenario's leak counts (``leaked_locks``, ``leaked_pins``,
        ``leaked_inflight``)."""
        held = self.record()
        return {f"leaked_{name}": held[name] for name in ("locks", "pins", "inflight")}

    def record(self) -> dict[str, int]:
        """What it held, for a scenario's details."""
        state = self.state
        return {
            "locks": state.num_locks,
            "pins": state.num_pins,
            "inflight": state.num_inflight,
            "sessions": self.sessions,
            "clients": self.clients,
        }


def get_stats(client: RpcClient) -> p.ServerStats | None:
    try:
        reply = client.call(p.GetStats())
    except (ServerUnavailable, RemoteError):
        return None
    assert isinstance(reply, p.ServerStats)
    return reply


def wait_quiescent(client: RpcClient, timeout_s: float, interval_s: float = 0.1) -> Held | None:
    """Polls until the server is quiescent or ``timeout_s`` passed; what it held last
    (``None`` if it never answered)."""
    deadline = time.monotonic() + timeout_s
    held = None
    while True:
        stats = get_stats(client)
        if stats is not None:
            held = Held.of(stats)
            if held.quiescent:
                return held
        if time.monotonic() >= deadline:
            return held
        time.sleep(interval_s)


class ServerWatch(Closing):
    """Samples one server's stats and RSS every ``interval_s`` until closed. Context manager.

    ``pid`` may change (a restarted server): assign :attr:`pid`. Samples that get no answer
    (the server is down) are skipped.
    """

    def __init__(self, url: str, token: str, pid: int, *, interval_s: float = 0.05) -> None:
        self.pid = pid
        self.samples = 0
        self.capacity_violations = 0
        self.max_used_bytes = 0
        self.max_rss_mib = 0.0
        self._client = RpcClient(url, role="chaos-watch", token=token, timeout_s=1.0)
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.sample()

    def sample(self) -> None:
        rss = rss_mib(self.pid)
        if rss is not None:
            self.max_rss_mib = max(self.max_rss_mib, rss)
        if not self._client.alive:  # down: the client's own heartbeats tell when it is back
            return
        stats = get_stats(self._client)
        if stats is None:
            return
        self.samples += 1
        self.max_used_bytes = max(self.max_used_bytes, stats.used_bytes)
        if stats.used_bytes > stats.capacity_bytes:
            self.capacity_violations += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        self._client.close()


def leftover_files(pids: set[int]) -> list[Path]:
    """Pool and token files named for servers ``pids`` that nobody owns any more (their owner
    lock is free) but that remain (where servers keep them: ``/dev/shm``, else the temporary
    directory)."""
    found = []
    for directory in {server_files_dir(), Path(tempfile.gettempdir())}:
        if not directory.is_dir():
            continue
        for path in directory.iterdir():
            match = SERVER_FILE.fullmatch(path.name)
            if match is not None and int(match.group(1)) in pids and not is_owned(path):
                found.append(path)
    return sorted(found)
