"""The Redis server a run starts for itself when a redis tier names no URL (the embedded store).

Runs in the process that owns the run's cache servers (``kvtb run``, ``kvtb server``, a test).
:class:`EmbeddedRedis` starts ``redis-server`` from ``$PATH`` as the leader of a process group
of its own (``testbed.core.process_groups``), listening on a unix socket and on no TCP port
(Redis's ``port 0``), so no port is picked or raced for; its URL is ``unix://SOCKET``, which
every cache server of the run then names. The socket lives in a private temporary directory
(a socket path must be short: 107 bytes), removed at :meth:`EmbeddedRedis.stop`; the log in
the directory it is given. Nothing persists (no RDB, no AOF): the store is the run's and is
gone when the run stops it.

Capacity is Redis's own: ``maxmemory`` is the tier's capacity plus :func:`maxmemory_for`'s
headroom for Redis's per-key overhead and the process's own memory, with
``maxmemory-policy allkeys-lru`` (Redis's approximate LRU over every key): the hierarchy keeps
what it stores within the tier's capacity by its own policy, and Redis evicts only beyond that
(when other servers share the store). :meth:`EmbeddedRedis.kill` and :meth:`EmbeddedRedis.start`
stop it as a crash would and start it again on the same socket (empty), for fault tests.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from testbed.core.process_groups import kill_group, start_group, stop_group

REDIS_SERVER = "redis-server"
INSTALL_HINT = "install it with `apt-get install redis-server` (Debian, Ubuntu)"
MAXMEMORY_POLICY = "allkeys-lru"
HEADROOM_FRACTION = 8
"""maxmemory = capacity + capacity / HEADROOM_FRACTION + HEADROOM_BYTES."""
HEADROOM_BYTES = 16 << 20
_STARTUP_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 10.0
_POLL_S = 0.02


class RedisMissing(RuntimeError):
    """``redis-server`` is not installed (the message says how to install it)."""


def redis_server_path() -> str | None:
    return shutil.which(REDIS_SERVER)


def require_redis_server() -> str:
    path = redis_server_path()
    if path is None:
        raise RedisMissing(f"a redis tier without a URL needs {REDIS_SERVER}: {INSTALL_HINT}")
    return path


def maxmemory_for(capacity_bytes: int) -> int:
    return capacity_bytes + capacity_bytes // HEADROOM_FRACTION + HEADROOM_BYTES


class EmbeddedRedis:
    """A ``redis-server`` on a unix socket in ``directory`` (module docstring). Context manager."""

    def __init__(self, directory: Path, capacity_bytes: int) -> None:
        self.directory = Path(directory)
        self.capacity_bytes = capacity_bytes
        self._socket_dir = Path(tempfile.mkdtemp(prefix="kvtb-redis-"))
        self.socket_path = self._socket_dir / "redis.sock"
        self.url = f"unix://{self.socket_path}"
        self.process: subprocess.Popen[Any] | None = None

    def command(self) -> list[str]:
        return [
            require_redis_server(),
            "--port", "0",
            "--unixsocket", str(self.socket_path),
            "--unixsocketperm", "700",
            "--dir", str(self.directory),
            "--save", "",
            "--appendonly", "no",
            "--maxmemory", str(maxmemory_for(self.capacity_bytes)),
            "--maxmemory-policy", MAXMEMORY_POLICY,
            "--logfile", str(self.directory / "redis.log"),
            "--loglevel", "warning",
        ]  # fmt: skip

    def start(self) -> EmbeddedRedis:
        """Starts it (again, after :meth:`kill` or :meth:`stop`) and waits until it answers."""
        assert self.process is None or self.process.poll() is not None, "already running"
        self.directory.mkdir(parents=True, exist_ok=True)
        self._socket_dir.mkdir(mode=0o700, exist_ok=True)
        self.socket_path.unlink(missing_ok=True)
        self.process = start_group(
            self.command(),
            die_with_parent=True,
            stdout=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
        )
        self._wait_ready()
        return self

    def stop(self) -> None:
        """Stops it and removes its socket's directory (a later :meth:`start` makes it again)."""
        if self.process is not None:
            stop_group(self.process, _STOP_TIMEOUT_S)
        shutil.rmtree(self._socket_dir, ignore_errors=True)

    def kill(self) -> None:
        """SIGKILL, as a crash would (what it held is lost)."""
        if self.process is not None and self.process.poll() is None:
            kill_group(self.process)

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        import redis

        assert self.process is not None
        client = redis.Redis(unix_socket_path=str(self.socket_path), socket_timeout=1.0)
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        try:
            while True:
                if self.process.poll() is not None:
                    log = self.directory / "redis.log"
                    tail = log.read_text()[-2000:] if log.exists() else ""
                    raise RuntimeError(f"{REDIS_SERVER} exited at start: {tail}")
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.TimeoutError, OSError):
                    pass
                if time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(f"{REDIS_SERVER} gave no answer in {_STARTUP_TIMEOUT_S} s")
                time.sleep(_POLL_S)
        finally:
            client.close()
