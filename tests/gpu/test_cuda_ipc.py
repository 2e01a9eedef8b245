"""The server-driven CUDA IPC path on a real GPU: a separate worker process, a real server.

Each test starts ``kvtb server --pool pinned-host`` or ``--pool gpu`` and a worker process
(``testbed.engine.cuda_worker``) whose paged KV lives on the GPU; the worker checks its own
blocks bit for bit and reports, and the test checks the server's state afterwards (nothing
pinned, nothing in flight). Skipped without a CUDA device; ``scripts/gpu_check.sh`` runs them
on a GPU machine in one command.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from testbed.core import protocol as p
from tests.support.cache_harness import connect

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA device (none on this machine); scripts/gpu_check.sh runs these",
    ),
]

POOLS = ["pinned-host", "gpu"]
SMALL = ("--num-layers", "4", "--num-blocks", "160", "--chunks", "4")


def _server(start_server, pool: str, *extra: str):
    return start_server("--chunk-size", "256", "--capacity", "1GiB", "--pool", pool, *extra)


def _worker(server, scenario: str, *args: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "testbed.engine.cuda_worker", scenario, "--url", server.url,
         "--token", server.token, *args],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _quiet(server) -> p.ServerStats:
    with connect(server, timeout_s=10.0) as rpc:
        stats = rpc.call(p.GetStats())
    assert isinstance(stats, p.ServerStats)
    assert (stats.num_pins, stats.num_inflight_stores, stats.num_inflight_retrieves) == (0, 0, 0)
    return stats


def test_cuda_ipc_works_between_two_processes():
    result = subprocess.run(
        [sys.executable, "-m", "testbed.engine.cuda_worker", "probe"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert json.loads(result.stdout.strip().splitlines()[-1])["ipc_works"], result.stderr


@pytest.mark.parametrize("pool", POOLS)
def test_round_trip_from_a_worker_process_is_bit_exact_and_skips_held_blocks(start_server, pool):
    server = _server(start_server, pool)
    assert server.ready["pool_medium"] == pool
    result = _worker(server, "roundtrip", *SMALL)
    assert result["stored"] and result["failed_blocks"] == 0
    assert result["bit_exact"]
    assert result["skipped_untouched"]  # skip_first_n_tokens: the engine's blocks untouched
    assert result["others_untouched"]
    assert result["events_lent_after"] == 0  # every exported event back once its op completed
    stats = _quiet(server)
    assert stats.num_objects == 4
    assert stats.retrieved_bytes == stats.stored_bytes > 0


@pytest.mark.parametrize("pool", POOLS)
def test_server_copies_wait_for_the_engines_events(start_server, pool):
    server = _server(start_server, pool)
    result = _worker(server, "ordering", *SMALL)
    assert result["stored"] and result["failed_blocks"] == 0
    assert result["store_saw_the_write"]  # not the bytes from before the forward pass
    assert result["retrieve_after_the_zeroing"]  # not overwritten by the engine's own work
    _quiet(server)


@pytest.mark.parametrize("pool", POOLS)
def test_mla_stores_one_copy_that_another_rank_loads(start_server, pool):
    server = _server(start_server, pool)
    result = _worker(server, "mla", *SMALL)
    assert result["stored"] and result["failed_blocks"] == 0 and result["bit_exact"]
    assert _quiet(server).num_objects == 4


def test_a_dead_workers_kv_is_closed_and_the_server_serves_the_next(start_server):
    server = _server(start_server, "pinned-host", "--client-timeout", "1")
    holder = subprocess.Popen(
        [sys.executable, "-m", "testbed.engine.cuda_worker", "hold", "--url", server.url,
         "--token", server.token, *SMALL],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and "registered" in holder.stdout.readline()
    finally:
        holder.kill()
        holder.wait()
    deadline_s = 20.0
    start = time.monotonic()
    while _quiet(server).num_workers and time.monotonic() - start < deadline_s:
        time.sleep(0.2)
    assert _quiet(server).num_workers == 0
    result = _worker(server, "roundtrip", *SMALL)
    assert result["bit_exact"] and result["failed_blocks"] == 0
