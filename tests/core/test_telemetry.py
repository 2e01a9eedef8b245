"""Spans for every cache operation, on both sides, linked across the process boundary."""

from __future__ import annotations

import json
import math
import time

import pandas as pd
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from testbed.analysis import load_spans
from testbed.core import telemetry
from testbed.core.telemetry import attributes as a
from testbed.core.telemetry.setup import TracingConfig, configure_tracing, read_counts
from tests.support.cache_harness import Harness, cache_cycle

C = 64

CONNECTOR_ATTRIBUTES = {
    a.CONNECTOR_LOOKUP: {
        a.SESSION_ID,
        a.TOKENS_REQUESTED,
        a.TOKENS_HIT,
        a.CHUNKS_HIT,
        a.WAIT_MS,
        a.OK,
    },
    a.CONNECTOR_STORE: {
        a.NUM_REQUESTS,
        a.CHUNKS,
        a.TOKENS,
        a.BLOCKS,
        a.BYTES,
        a.CHUNKS_WRITTEN,
        a.OK,
        a.COPY_MS,
    },
    a.CONNECTOR_RETRIEVE: {
        a.NUM_REQUESTS,
        a.CHUNKS,
        a.TOKENS,
        a.BLOCKS,
        a.BYTES,
        a.CHUNKS_MISSING,
        a.OK,
        a.LOCKS_RELEASED,
    },
    a.CONNECTOR_LOCK_RELEASE: {a.SESSION_ID, a.RANGE_START, a.RANGE_END, a.CHUNKS, a.OK},
    a.CONNECTOR_END_SESSION: {a.SESSION_ID, a.OK},
}
SERVER_ATTRIBUTES = {
    a.SERVER_LOOKUP: {a.SESSION_ID, a.TOKENS_REQUESTED, a.TOKENS_HIT, a.CHUNKS_HIT, a.LOCKS_TAKEN},
    a.SERVER_STORE: {a.OP, a.USED_BYTES},
    a.SERVER_RETRIEVE: {a.OP, a.NUM_REQUESTS},
    a.SERVER_LOCK_RELEASE: {a.SESSION_ID, a.RANGE_START, a.RANGE_END, a.CHUNKS, a.LOCKS_RELEASED},
    a.SERVER_END_SESSION: {a.SESSION_ID, a.CHUNKS},
}


@pytest.fixture
def memory_tracing(tmp_path):
    exporter = InMemorySpanExporter()
    tracing = configure_tracing(
        TracingConfig("test-engine", run_dir=tmp_path / "engine"), {"memory": exporter}
    )
    yield tracing, exporter
    tracing.shutdown()


def _spans_with(frame: pd.DataFrame, name: str) -> pd.DataFrame:
    return frame[frame["name"] == name]


def test_every_operation_leaves_a_span_on_both_sides_parented_across_processes(
    start_server, tmp_path, memory_tracing
):
    tracing, exporter = memory_tracing
    server = start_server("--chunk-size", str(C), "--run-dir", str(tmp_path / "server"))
    with telemetry.traced(a.REQUEST) as request_span, Harness(server) as h:
        outcome = cache_cycle(h, C, traceparent=telemetry.traceparent_of(request_span))
    assert outcome["restored"] and outcome["locks"] == 0
    server.close()
    tracing.force_flush()
    client = {s.name for s in exporter.get_finished_spans()}
    assert set(CONNECTOR_ATTRIBUTES) <= client
    for span in exporter.get_finished_spans():
        if span.name in CONNECTOR_ATTRIBUTES:
            assert span.kind == telemetry.SpanKind.CLIENT
            missing = CONNECTOR_ATTRIBUTES[span.name] - set(span.attributes)
            assert not missing, (span.name, missing)
    client_ids = {
        (f"{s.context.trace_id:032x}", f"{s.context.span_id:016x}")
        for s in exporter.get_finished_spans()
    }
    server_spans = load_spans(tmp_path / "server")
    assert set(SERVER_ATTRIBUTES) <= set(server_spans["name"])
    for name, expected in SERVER_ATTRIBUTES.items():
        spans = _spans_with(server_spans, name)
        assert (spans["kind"] == "SERVER").all()
        for key in expected:
            assert spans[key].notna().all(), (name, key)
        for trace_id, parent in zip(spans["trace_id"], spans["parent_span_id"], strict=True):
            assert (trace_id, parent) in client_ids, name  # child of the connector span
    lookups = _spans_with(server_spans, a.SERVER_LOOKUP)
    assert sorted(lookups[a.TOKENS_HIT]) == [0, 3 * C]
    commit = server_spans[server_spans[a.OP] == "store_commit"]
    assert commit[a.BYTES].sum() == outcome["stored_bytes"]
    (request_trace,) = {
        f"{s.context.trace_id:032x}" for s in exporter.get_finished_spans() if s.name == a.REQUEST
    }
    cache_ops = server_spans[server_spans["name"] != a.SERVER_REGISTER]
    assert set(cache_ops["trace_id"]) == {request_trace}  # one trace, connector to server


def test_evictions_and_expired_locks_have_their_spans(start_server, tmp_path):
    object_bytes = C * 128
    server = start_server(
        "--chunk-size", str(C),
        "--capacity", str(2 * object_bytes),
        "--read-lock-ttl", "0.3",
        "--run-dir", str(tmp_path),
    )  # fmt: skip
    with Harness(server) as h:
        h.prefill("a", list(range(2 * C + 1)), list(range(9)), traceparent=_traceparent(1))
        h.matched("locker", list(range(2 * C + 1)))
        time.sleep(1.0)  # the locker's locks expire
        h.prefill("b", [7] * (C + 1), list(range(5)))
    server.close()
    spans = load_spans(tmp_path)
    (evict,) = _spans_with(spans, a.SERVER_EVICT).to_dict("records")
    assert evict[a.EVICTED_OBJECTS] == 1 and evict[a.EVICTED_BYTES] == object_bytes
    assert evict[a.EVICT_REASON] == "capacity" and evict[a.POLICY] == "lru"
    (store_a,) = _spans_with(spans, a.SERVER_STORE)[
        lambda f: (f[a.OP] == "store_begin") & (f["trace_id"] == "ab" * 16)
    ]["span_id"]
    assert evict["links"] == (f"{'ab' * 16}:{store_a}",)  # the store that wrote the object
    assert list(evict[a.SESSION_IDS]) == ["engine:a"]  # and the request it stored for
    expiry = _spans_with(spans, a.SERVER_LOCK_EXPIRE).iloc[0]
    assert expiry[a.CHUNKS] == 2 and expiry[a.LOCKS_RELEASED] == 2
    assert expiry[a.HELD_MS] >= 300 and expiry[a.SESSION_ID] == "engine:locker"


def _traceparent(span_id: int) -> str:
    return f"00-{'ab' * 16}-{span_id + 0xA0:016x}-01"


def test_span_files_load_back_exactly_as_the_in_memory_exporter_saw_them(
    start_server, tmp_path, memory_tracing
):
    tracing, exporter = memory_tracing
    server = start_server("--chunk-size", str(C))
    with (
        telemetry.traced(a.REQUEST, attributes={a.REQUEST_ID: "r"}) as root,
        Harness(server) as h,
    ):
        cache_cycle(h, C, traceparent=telemetry.traceparent_of(root))
    counts = tracing.shutdown()
    memory = exporter.get_finished_spans()
    loaded = load_spans(tmp_path / "engine").set_index("span_id")
    # The request, 2 connector request spans, 7 cache operations, 1 worker registration.
    assert len(loaded) == len(memory) == counts["ended"] == 11
    assert read_counts(tmp_path / "engine") == {"spans_exported": len(memory), "spans_dropped": 0}
    for span in memory:
        row = loaded.loc[f"{span.context.span_id:016x}"]
        assert row["name"] == span.name and row["trace_id"] == f"{span.context.trace_id:032x}"
        assert row["parent_span_id"] == (f"{span.parent.span_id:016x}" if span.parent else "")
        assert row["kind"] == span.kind.name
        for key, value in span.attributes.items():
            stored = row["rank" if key == a.RANK else key]  # the TP rank becomes the rank column
            if isinstance(value, float):
                assert math.isclose(stored, value), key
            elif isinstance(value, tuple):
                assert list(stored) == list(value), key
            else:
                assert stored == value, key
        assert len(row["links"]) == len(span.links)


def test_tracing_off_emits_nothing_and_changes_nothing(start_server, tmp_path, monkeypatch):
    on_server = start_server("--chunk-size", str(C), "--run-dir", str(tmp_path / "on"))
    exporter = InMemorySpanExporter()
    tracing = configure_tracing(TracingConfig("engine"), {"memory": exporter})
    with Harness(on_server) as h:
        traced_outcome = cache_cycle(h, C)
    tracing.shutdown()
    assert exporter.get_finished_spans()

    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert configure_tracing(TracingConfig("engine", run_dir=tmp_path / "off-engine")) is None
    off_server = start_server("--chunk-size", str(C), "--run-dir", str(tmp_path / "off"))
    exporter.clear()
    assert not telemetry.enabled()
    with Harness(off_server) as h:
        plain_outcome = cache_cycle(h, C)
    off_server.close()
    assert plain_outcome == traced_outcome
    assert exporter.get_finished_spans() == ()
    assert not (tmp_path / "off" / "spans").exists() and not (tmp_path / "off-engine").exists()


def test_traced_works_as_a_decorator_and_marks_errors(memory_tracing):
    tracing, exporter = memory_tracing

    @telemetry.traced("kvcache.test.decorated", attributes={a.CHUNKS: 3})
    def work(fail: bool) -> int:
        if fail:
            raise RuntimeError("boom")
        return 7

    assert work(False) == 7
    with pytest.raises(RuntimeError):
        work(True)
    tracing.force_flush()
    spans = [s for s in exporter.get_finished_spans() if s.name == "kvcache.test.decorated"]
    assert [s.status.status_code.name for s in spans] == ["UNSET", "ERROR"]
    assert all(s.attributes[a.CHUNKS] == 3 for s in spans)


def test_span_ids_differ_across_forked_and_seeded_processes():
    """vLLM seeds Python's global ``random`` alike in every process, and forks: ids must come
    from neither the global generator nor a copy of the parent's."""
    import os
    import random

    from testbed.core.telemetry.setup import SystemIdGenerator

    ids = SystemIdGenerator()
    ids.generate_span_id()  # the parent's generator exists before the fork
    children = []
    for _ in range(2):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: seeded as vLLM seeds it, then one id
            random.seed(0)
            os.write(write, ids.generate_span_id().to_bytes(8, "big"))
            os._exit(0)
        os.close(write)
        children.append(int.from_bytes(os.read(read, 8), "big"))
        os.close(read)
        os.waitpid(pid, 0)
    assert len({*children, ids.generate_span_id()}) == 3


def test_span_file_lines_are_the_otlp_json_documents_of_their_spans():
    """The exporter writes its lines as text; parsed, each is exactly ``encode_traces_data``."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.trace import StatusCode

    from testbed.core.telemetry.otlp_json import encode_traces_data, group_spans
    from testbed.core.telemetry.otlp_text import traces_data_text

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("t", "1.2")
    values = {"s": 'quote " and é\n', "i": -(2**62), "f": 1 / 3, "inf": math.inf, "b": True,
              "l": ["a", "b"], "li": [1, 2], "e": [], "by": b"\x00\xff"}  # fmt: skip
    with tracer.start_as_current_span("root", attributes=values) as root:
        with tracer.start_as_current_span("child", links=[trace.Link(root.get_span_context())]):
            trace.get_current_span().add_event("ev", {"k": 1})
        failed = tracer.start_span("failed")
        failed.set_status(StatusCode.ERROR, "why")
        failed.end()
    spans = exporter.get_finished_spans()
    groups = group_spans(spans)
    assert json.loads(traces_data_text(groups)) == json.loads(
        json.dumps(encode_traces_data(groups))
    )
