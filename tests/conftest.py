"""Shared fixtures: real cache server processes on 127.0.0.1 (port 0) and clients for them."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from testbed.launch import ServerProcess

StartServer = Callable[..., ServerProcess]


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
