"""Starting a cache server process and waiting until it is ready.

:class:`ServerProcess` runs ``python -m server`` with the given flags (``--port 0`` by
default), reads the readiness line for the bound endpoint, its epoch and its token file
(whose client and admin tokens it then holds), and on close stops it with everything in its
process group (``testbed.core.process_groups``: SIGTERM, a wait, then SIGKILL) so no test or run
leaves a server behind; it also exits by itself when its starter does (``--exit-with-parent``).
The server leads a session of its own, so a terminal's Ctrl-C reaches the command that started
it, which stops it in order. The server runs in the caller's working
directory, with this package importable from it; paths it is given should be absolute (the
command line makes them so), so that nothing depends on where it runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from server.app import READY_PREFIX
from testbed.core.credentials import read_token_file
from testbed.core.process_groups import kill_group, start_group, stop_group

_STARTUP_TIMEOUT_S = 60.0


class ServerStartError(RuntimeError):
    pass


class ServerProcess:
    """A cache server subprocess on loopback. Context manager."""

    def __init__(
        self,
        args: Sequence[str] = (),
        *,
        env: Mapping[str, str] | None = None,
        log_path: Path | None = None,
        startup_timeout_s: float = _STARTUP_TIMEOUT_S,
        wrapper: Sequence[str] = (),
    ) -> None:
        port = [] if "--port" in args else ["--port", "0"]
        self.args = ["--exit-with-parent", *port, *args]
        self._wrapper = list(wrapper)
        """A command the server runs under (``prlimit ...``, a private mount namespace),
        which must end by executing the rest of its arguments in the same process."""
        self._env = {**os.environ, **(env or {})}
        self._log_path = log_path
        self._startup_timeout_s = startup_timeout_s
        self.process: subprocess.Popen[str] | None = None
        self.url = ""
        self.ready: dict[str, str] = {}
        """The readiness line's fields (endpoint, pid, epoch, token_file, prefault_ms, pool)."""
        self.token = ""
        self.admin_token = ""
        self._stderr_lines: list[str] = []

    def start(self) -> ServerProcess:
        stderr = open(self._log_path, "a") if self._log_path else subprocess.PIPE  # noqa: SIM115
        self.process = start_group(
            [*self._wrapper, sys.executable, "-m", "server", *self.args],
            stdout=subprocess.PIPE,
            stderr=stderr,
            stdin=subprocess.DEVNULL,
            text=True,
            env=_importable(self._env),
        )
        if stderr is subprocess.PIPE:
            threading.Thread(target=self._drain_stderr, daemon=True).start()
        try:
            self.url = self._wait_ready()
        except BaseException:  # Ctrl-C while it starts: ``with`` would not call __exit__
            self.close()
            raise
        threading.Thread(target=self._drain_stdout, daemon=True).start()
        return self

    def _wait_ready(self) -> str:
        assert self.process is not None and self.process.stdout is not None
        deadline = time.monotonic() + self._startup_timeout_s
        result: list[str] = []

        def read() -> None:
            assert self.process is not None and self.process.stdout is not None
            for line in self.process.stdout:
                if line.startswith(READY_PREFIX):
                    result.append(line)
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(max(0.0, deadline - time.monotonic()))
        if not result:
            exited_early = not reader.is_alive()  # its output ended: it exited
            self.close()
            lines = self._stderr_lines
            if self._log_path is not None and self._log_path.is_file():
                lines = self._log_path.read_text(errors="replace").splitlines(keepends=True)
            detail = "".join(lines[-20:]).strip() or "(no output)"
            code = self.process.returncode
            if exited_early:
                raise ServerStartError(f"cache server exited with code {code} at start:\n{detail}")
            raise ServerStartError(
                f"cache server did not become ready within {self._startup_timeout_s:.0f}s; "
                f"exit code {code}; stderr:\n{detail}"
            )
        self.ready = dict(part.split("=", 1) for part in result[0].split()[1:])
        credentials = read_token_file(self.ready["token_file"])
        self.token, self.admin_token = credentials.client, credentials.admin
        return self.ready["endpoint"]

    def _drain_stdout(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for _ in self.process.stdout:
            pass

    def _drain_stderr(self) -> None:
        assert self.process is not None and self.process.stderr is not None
        for line in self.process.stderr:
            self._stderr_lines.append(line)
            del self._stderr_lines[:-200]

    @property
    def token_file(self) -> Path:
        return Path(self.ready["token_file"])

    @property
    def epoch(self) -> int:
        return int(self.ready["epoch"])

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def kill(self) -> None:
        """Kills the server abruptly (SIGKILL), as a crash would (its files stay behind, for
        the next server start or ``kvtb clean`` to reclaim)."""
        if self.process is not None and self.process.poll() is None:
            kill_group(self.process)

    def close(self, timeout_s: float = 10.0) -> int | None:
        """Stops the server and its process group (SIGTERM, then SIGKILL); returns its exit
        code."""
        if self.process is None:
            return None
        stop_group(self.process, timeout_s)
        return self.process.returncode

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _importable(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with this package's import root on ``PYTHONPATH`` when it is a source tree (not
    an installed site directory), so that ``python -m server`` finds it from any directory."""
    root = Path(__file__).resolve().parent.parent
    if root.name in ("site-packages", "dist-packages"):
        return dict(env)
    paths = [str(root), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    return {**env, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}
