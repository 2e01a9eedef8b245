"""A server started by a launcher does not outlive it, even when the launcher is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time


def test_a_server_exits_when_its_launcher_is_killed(tmp_path):
    script = textwrap.dedent(
        """
        import sys, time
        from server.launch import ServerProcess
        server = ServerProcess(["--chunk-size", "64"]).start()
        print(server.pid, flush=True)
        time.sleep(600)
        """
    )
    launcher = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=os.getcwd()
    )
    server_pid = int(launcher.stdout.readline())
    os.kill(launcher.pid, signal.SIGKILL)  # no cleanup code runs in the launcher
    launcher.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(server_pid):
        time.sleep(0.1)
    assert not _alive(server_pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by init) counts as gone.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split()[2] != "Z"
