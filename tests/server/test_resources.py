"""A server when the machine runs out: shared memory, disk, descriptors, and its files.

Each test reproduces one finding of a hostile operator (an engine killed by ``SIGBUS``, a
pool silently on disk, a server that exited on a full disk, a live server's files deleted
from another PID namespace, a world-readable token file reused) and checks what replaced it.
Exhausted file systems are made in a private mount namespace (``private_mounts``), never on
the machine's own ``/dev/shm``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from server.launch import ServerProcess, ServerStartError
from server.reclaim import reclaim_dead_server_files
from testbed.chaos.mounts import Tmpfs
from testbed.core import protocol as p
from testbed.core.owned_files import create_locked, owned_name
from testbed.core.rpc import RemoteError
from tests.server.test_protocol_flows import stats
from tests.support.cache_harness import connect

SHM = Path("/dev/shm")

# ---------------------------------------------------------------------------------------------
# Shared memory: promised when the pool is made, refused when it is not there
# ---------------------------------------------------------------------------------------------


def test_a_pool_keeps_its_memory_when_another_process_fills_dev_shm(private_mounts):
    """Used to die of SIGBUS (rc 135) on the first store once /dev/shm was full: the pool's
    pages were only allocated as they were first touched."""
    probe = ["-m", "testbed.chaos.shm_probe", "--pool-mib", "24", "--chunks", "2048"]
    done = private_mounts.run_python([Tmpfs(SHM, 40 << 20)], *probe, timeout_s=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])  # -7: SIGBUS
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["errors"] == 0 and result["stored_bytes"] == 2048 * 64 * 128  # 16 MiB
    assert result["refusal"]["exit_code"] == 2  # a pool that no longer fits is refused
    assert "cannot reserve a shm cache pool of 8.0 MiB" in result["refusal"]["message"]


def test_a_pool_that_does_not_fit_dev_shm_is_refused_unless_disk_is_asked_for(
    private_mounts, tmp_path
):
    """Used to be created in /tmp on disk, silently: copy times then measured a disk."""
    small_shm = private_mounts.wrapper([Tmpfs(SHM, 16 << 20)])
    tokens = ["--token-file", str(tmp_path / "tokens.json")]  # readable outside the namespace
    with pytest.raises(ServerStartError) as refused:
        ServerProcess(["--capacity", "32MiB", *tokens], wrapper=small_shm).start()
    message = str(refused.value)
    assert "exited with code 2" in message
    assert "32.0 MiB" in message and "16.0 MiB free" in message and "--pool disk" in message

    args = ["--capacity", "32MiB", "--pool", "disk", "--pool-dir", str(tmp_path), *tokens]
    with ServerProcess(args, wrapper=small_shm) as server:
        assert server.ready["pool_medium"] == "disk"
        pools = list(tmp_path.glob("kvtb-pool-*"))
        assert len(pools) == 1 and pools[0].stat().st_blocks * 512 >= 32 << 20  # reserved
        with connect(server) as client:
            assert client.call(p.GetConfig()).pool_medium == "disk"


# ---------------------------------------------------------------------------------------------
# A full disk costs spans and chunk log rows, not the service
# ---------------------------------------------------------------------------------------------

FULL_SPAN_DIR = """
import json, sys
from pathlib import Path
from testbed.chaos.mounts import fill
from testbed.chaos.probes import ProbeClient
from server.launch import ServerProcess

run_dir, log = Path(sys.argv[1]), Path(sys.argv[2])
args = ["--chunk-size", "64", "--capacity", "16MiB", "--run-dir", str(run_dir)]
server = ServerProcess(args, log_path=log).start()
with ProbeClient(server.url, server.token) as client:
    client.register()
    before = client.cycle("before", num_chunks=8)
    fill(run_dir)  # the disk under the span directory and the chunk log is full
    errors = sum(client.cycle(f"full-{i}", num_chunks=64) for i in range(20))
    stats = client.stats()
code = server.close()
counts = json.loads(next((run_dir / "spans").glob("*.counts.json")).read_text())
print(json.dumps({"errors": before + errors, "exit_code": code, "spans": counts["exporters"],
                  "not_written": stats.chunk_events_dropped + stats.chunk_events_pending}))
"""


def test_a_server_whose_disk_is_full_keeps_serving_and_counts_what_it_dropped(
    private_mounts, tmp_path
):
    """Used to exit at the first chunk log write that failed: every client then timed out."""
    run_dir, log = tmp_path / "run", tmp_path / "server.log"
    run_dir.mkdir()
    code = FULL_SPAN_DIR.replace("sys.argv[1]", repr(str(run_dir))).replace(
        "sys.argv[2]", repr(str(log))
    )
    done = private_mounts.run_python([Tmpfs(run_dir, 1 << 20)], "-c", code, timeout_s=120)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["errors"] == 0 and result["exit_code"] == 0
    assert result["not_written"] > 0  # counted: kept in memory, lost when it stopped
    warnings = log.read_text()
    assert warnings.count("cannot write chunk log rows") == 1, warnings  # once, not per batch
    assert warnings.count("cannot write spans") == 1, warnings
    spans = result["spans"]["file"]  # its counts file had its space reserved at start
    assert spans["dropped"] > 0 and "No space left on device" in spans["error"]


# ---------------------------------------------------------------------------------------------
# Liveness by lock: files of live servers survive a cleanup from any PID namespace
# ---------------------------------------------------------------------------------------------


def _in_other_pid_namespace(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", *command],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_kvtb_clean_in_another_pid_namespace_leaves_a_live_servers_files(
    private_mounts, start_server
):
    """Liveness used to be the pid in the file name: from another PID namespace (a container
    sharing /dev/shm) that pid does not run, so the live server's pool and token went."""
    server = start_server("--chunk-size", "64", "--capacity", "4MiB")
    pid = server.pid
    files = sorted(SHM.glob(f"kvtb-*-{pid}-*"))
    assert len(files) == 2  # its pool and its token file
    clean = _in_other_pid_namespace(sys.executable, "-m", "testbed.cli", "clean")
    if clean.returncode != 0 and "unshare" in clean.stderr:
        pytest.skip(f"cannot make a PID namespace here: {clean.stderr.strip()}")
    assert clean.returncode == 0, clean.stderr
    assert all(path.exists() for path in files), clean.stdout
    with connect(server) as client:
        assert stats(client).num_clients >= 1  # still serving
    server.kill()  # now nobody holds their locks: any namespace may reclaim them
    clean = _in_other_pid_namespace(sys.executable, "-m", "testbed.cli", "clean")
    assert clean.returncode == 0 and not any(path.exists() for path in files), clean.stdout


def test_files_of_earlier_versions_are_kept_while_their_pid_runs(tmp_path):
    """Servers of earlier versions hold no lock (8 hex digits in their names): their files
    are removed only once no process has their pid here; ours by their lock alone."""
    live_legacy = tmp_path / f"kvtb-pool-{os.getpid()}-0123abcd"
    dead_legacy = tmp_path / f"kvtb-pool-{_dead_pid()}-0123abcd"
    for path in (live_legacy, dead_legacy):
        path.write_bytes(b"x")
    held = create_locked(tmp_path / owned_name("kvtb-token-", ".json"))
    abandoned = tmp_path / owned_name("kvtb-pool-")
    create_locked(abandoned).close()
    removed = reclaim_dead_server_files([tmp_path])
    assert sorted(removed) == sorted([dead_legacy, abandoned])
    assert live_legacy.exists() and held.path.exists()
    held.close()


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


# ---------------------------------------------------------------------------------------------
# Token files like ssh keys
# ---------------------------------------------------------------------------------------------


def test_a_token_file_others_may_read_is_refused_with_the_fix(tmp_path):
    """Used to be reused silently (mode 0644)."""
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"client": "c" * 48, "admin": "a" * 48}))
    tokens.chmod(0o644)
    done = subprocess.run(
        [sys.executable, "-m", "server", "--port", "0", "--token-file", str(tokens)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and f"chmod 600 {tokens}" in done.stderr, done.stderr
    tokens.chmod(0o600)
    tokens.write_text(json.dumps({"client": "c" * 300, "admin": "a" * 48}))
    with pytest.raises(ValueError, match="300 characters"):
        from testbed.core.credentials import read_token_file

        read_token_file(tokens)


# ---------------------------------------------------------------------------------------------
# Descriptors: connections that never authenticate cannot lock clients out
# ---------------------------------------------------------------------------------------------


def test_idle_unauthenticated_connections_cannot_lock_out_clients(tmp_path):
    """350 connections that never send a request used to take every descriptor of a server
    under ``ulimit -n 256``: new clients got no answer, and nothing was logged."""
    log = tmp_path / "server.log"
    args = ["--chunk-size", "64", "--capacity", "4MiB", "--auth-timeout", "30"]
    limit = ["prlimit", "--nofile=256:256"]
    with ServerProcess(args, wrapper=limit, log_path=log) as server:
        host, port = server.url.removeprefix("tcp://").rsplit(":", 1)
        idle = []
        try:
            for _ in range(10):  # in bursts the listen backlog holds, as a flood arrives
                idle += [_connect_idle(host, int(port)) for _ in range(35)]
                time.sleep(0.2)
            time.sleep(1.0)  # the server accepts them (and closes what is over its cap)
            started = time.monotonic()
            with connect(server, timeout_s=10.0) as client:
                closed = stats(client).unauthenticated_closed
            waited_s = time.monotonic() - started
        finally:
            for sock in idle:
                sock.close()
    assert closed > 0  # beyond the cap (a quarter of 256) at once, long before the timeout
    assert waited_s < 10.0
    assert "connection(s) that sent no authenticated request" in log.read_text()


def _connect_idle(host: str, port: int):
    import socket

    sock = socket.socket()
    sock.setblocking(False)
    sock.connect_ex((host, port))  # never sends anything, not even ZeroMQ's greeting
    return sock


# ---------------------------------------------------------------------------------------------
# Per-client quotas: one client cannot starve the others
# ---------------------------------------------------------------------------------------------


def test_one_client_cannot_take_the_lock_table_from_the_others(start_server):
    """One client's lookups used to fill the server-wide lock table: every other client was
    refused until the read-lock TTL (300 s) freed it."""
    from tests.server.test_protocol_flows import Worker, lookup

    server = start_server("--chunk-size", "64", "--max-tracked-chunks", "4000")
    hashes = [i.to_bytes(16, "little") for i in range(300)]
    with Worker(server) as worker, connect(server) as hog, connect(server) as other:
        worker.store("writer", hashes)
        taken = 0
        refusal = None
        for i in range(20):
            reply = hog.submit(
                p.Lookup(session_id=f"hog{i}", model="m", world_size=1, chunk_hashes=hashes)
            ).result(10.0)
            if isinstance(reply, p.Error):
                refusal = reply
                break
            taken += reply.hit_chunks
        assert refusal is not None and refusal.code == "quota", refusal
        # Its quota: a quarter of the 4,000 tracked chunks. A lookup of 300 tracks 600 (its
        # lock group and its session's refresh list), so the second one is refused.
        assert taken == 300
        assert lookup(other, "other", hashes).num_locks == 300  # the others go on
        assert stats(other).refused_quotas == 1


def test_operations_in_flight_and_pending_lookups_are_bounded_per_client(start_server):
    from tests.server.test_protocol_flows import Worker, lookup

    server = start_server(
        "--chunk-size", "64",
        "--max-inflight-ops-per-client", "2",
        "--max-pending-lookups-per-client", "1",
        "--lookup-pending-timeout", "30",
    )  # fmt: skip
    with Worker(server) as greedy, Worker(server, role="other") as other:
        greedy.begin_store("a", [b"a" * 16])
        greedy.begin_store("b", [b"b" * 16])
        with pytest.raises(RemoteError) as refused:
            greedy.begin_store("c", [b"c" * 16])
        assert refused.value.code == "quota"
        assert other.store("d", [b"d" * 16]).num_committed == 1  # another client is not held
        with connect(server) as scheduler:
            assert lookup(scheduler, "wait-a", [b"a" * 16]).pending  # waits on the store
            second = lookup(scheduler, "wait-b", [b"b" * 16])
        assert not second.pending and second.miss_status == "in_flight"  # answered at once
