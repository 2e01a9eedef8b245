"""The span recorder: rows in columns on the request path, the SDK's spans at export, and the
same DataFrame for the analyst as the SDK's own provider gives."""

from __future__ import annotations

import json
from collections import Counter

import pandas as pd
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from testbed.analysis import load_events, load_spans
from testbed.core import telemetry
from testbed.core.telemetry import attributes as a
from testbed.core.telemetry import recorder
from testbed.core.telemetry.setup import TracingConfig, configure_tracing, read_counts
from tests.support.cache_harness import Harness, cache_cycle

C = 64
_IDS = ["trace_id", "span_id", "parent_span_id", "start_time", "end_time", "links",
        "resource.process.pid", a.EPOCH]  # fmt: skip


def _per_run(frame: pd.DataFrame) -> list[str]:
    """Columns that differ between any two runs (ids, clocks, the process, times taken):
    compared by where they have values."""
    return [c for c in frame.columns if c in _IDS or c.endswith("_ms")]


def _operations(server: object) -> None:
    """Every kind of span content: attributes set, overwritten and added late, events, an
    exception, links, a fleet instance, an explicit start time, and a real cache cycle."""
    with telemetry.traced(a.REQUEST, attributes={a.REQUEST_ID: "r", a.CHUNKS: 1}) as root:
        root.set_attribute(a.CHUNKS, 2)  # an overwritten key
        root.set_attributes({a.TOKENS: 5, a.OK: True})
        root.add_event("kvcache.request.part", {a.TOKENS: 3})
        parent = telemetry.traceparent_of(root)
        with Harness(server) as h:  # type: ignore[arg-type]
            cache_cycle(h, C, traceparent=parent)
        with telemetry.instance_scope(3), telemetry.traced("kvcache.test.linked", links=[parent]):
            pass
        with pytest.raises(ValueError), telemetry.traced("kvcache.test.failed"):
            raise ValueError("bad input")
        late = telemetry.start_span("kvcache.test.late", start_time_ns=1_000_000_000)
        telemetry.fail(late, "gave up")
        late.end()


def _record(tmp_path, server, *, use_recorder: bool) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    run_dir = tmp_path / ("recorder" if use_recorder else "sdk") / "run"
    tracing = configure_tracing(
        TracingConfig("test-engine", run_dir=run_dir, recorder=use_recorder)
    )
    assert tracing is not None
    assert isinstance(tracing.provider, recorder.RecorderProvider) == use_recorder
    _operations(server)
    counts = tracing.shutdown()
    return load_spans(run_dir), load_events(run_dir), counts


def _comparable(frame: pd.DataFrame) -> pd.DataFrame:
    frame = frame.sort_values(["name", a.OP if a.OP in frame else "name"], kind="stable")
    return frame.drop(columns=_per_run(frame)).reset_index(drop=True)


def _comparable_events(frame: pd.DataFrame) -> pd.DataFrame:
    frame = frame.drop(columns=["time", "span_id", "trace_id", "exception.stacktrace"])
    return frame.sort_values(["span_name", "event"], kind="stable").reset_index(drop=True)


def test_spans_from_the_recorder_load_into_the_same_dataframe_column_for_column(
    start_server, tmp_path
):
    sdk, sdk_events, sdk_counts = _record(
        tmp_path, start_server("--chunk-size", str(C)), use_recorder=False
    )
    rows, row_events, row_counts = _record(
        tmp_path, start_server("--chunk-size", str(C)), use_recorder=True
    )
    assert list(rows.columns) == list(sdk.columns)
    assert list(rows.dtypes) == list(sdk.dtypes)
    pd.testing.assert_frame_equal(_comparable(rows), _comparable(sdk))
    for column in _per_run(sdk):  # present alike, filled alike
        assert list(rows[column].isna()) == list(sdk[column].isna()), column
    assert [len(links) for links in rows["links"]] == [len(links) for links in sdk["links"]]
    assert len(row_events) == len(sdk_events) > 0
    pd.testing.assert_frame_equal(_comparable_events(row_events), _comparable_events(sdk_events))
    assert row_counts["ended"] == sdk_counts["ended"] == len(rows)
    late = rows[rows["name"] == "kvcache.test.late"].iloc[0]
    assert late["start_time"] == pd.Timestamp(1_000_000_000, unit="ns", tz="UTC")
    assert late["status"] == "ERROR" and late["status_message"] == "gave up"
    failed = rows[rows["name"] == "kvcache.test.failed"].iloc[0]
    assert failed["status"] == "ERROR" and "bad input" in failed["status_message"]


def test_spans_beyond_the_pending_limit_are_refused_and_counted_as_dropped(tmp_path, monkeypatch):
    monkeypatch.setattr(recorder, "MAX_PENDING", 5)
    monkeypatch.setattr(recorder, "EXPORT_DELAY_S", 3600.0)  # nothing exported until shutdown
    exporter = InMemorySpanExporter()
    tracing = configure_tracing(
        TracingConfig("test-engine", run_dir=tmp_path), {"memory": exporter}
    )
    assert tracing is not None
    for index in range(8):
        with telemetry.traced("kvcache.test.op", attributes={a.CHUNKS: index}):
            pass
    counts = tracing.shutdown()
    assert [s.attributes[a.CHUNKS] for s in exporter.get_finished_spans()] == [0, 1, 2, 3, 4]
    assert tracing.provider.refused == 3  # type: ignore[union-attr]
    assert counts["ended"] == 8 and counts["exporters"]["memory"]["dropped"] == 3
    assert read_counts(tmp_path) == {"spans_exported": 5, "spans_dropped": 3}


def test_a_synchronous_span_file_holds_each_span_as_it_ends(tmp_path):
    tracing = configure_tracing(TracingConfig("test-engine", run_dir=tmp_path, synchronous=True))
    assert tracing is not None
    with telemetry.traced("kvcache.test.op", attributes={a.CHUNKS: 4}):
        pass
    assert tracing.span_file is not None
    assert "kvcache.test.op" in tracing.span_file.read_text()  # before any flush or shutdown
    assert read_counts(tmp_path) == {"spans_exported": 1, "spans_dropped": 0}
    tracing.shutdown()


def _values(span: telemetry.Span, mixed: bool) -> None:
    """Every kind of attribute value: lists and tuples of one type (kept, as tuples) and,
    where ``mixed``, lists of two types (what the SDK's bounded map makes of them), in spans
    and events."""
    span.set_attributes({"x.strs": ["a", "b"], "x.floats": (0.5, 1.5), "x.empty": []})
    span.set_attributes({"x.flag": True, "x.count": 3, "x.name": "n"})
    span.add_event("x.event", {"x.ints": [1, 2], "x.name": "e"})
    if mixed:
        span.set_attribute("x.mixed", [1, "a"])
        span.add_event("x.bounded", {"x.mixed": [1.0, "b"], "x.kept": 1})


def _raw_spans(run_dir) -> list[dict]:
    """The span file's spans as OTLP JSON objects."""
    spans = []
    for path in (run_dir / "spans").glob("*.jsonl"):
        for line in path.read_text().splitlines():
            for resource in json.loads(line)["resourceSpans"]:
                for scope in resource["scopeSpans"]:
                    spans.extend(scope["spans"])
    return spans


def _span_file_spans(run_dir) -> list[dict]:
    """The span file's spans as OTLP JSON objects, ids and clocks removed, in name order."""
    spans = _raw_spans(run_dir)
    for span in spans:
        for key in ("traceId", "spanId", "parentSpanId", "startTimeUnixNano", "endTimeUnixNano"):
            span.pop(key)
        for event in span.get("events", []):
            event.pop("timeUnixNano")
        for link in span.get("links", []):
            link.pop("traceId"), link.pop("spanId")
    return sorted(spans, key=lambda span: span["name"])


@pytest.mark.parametrize(
    ("count_limit", "synchronous"), [(None, False), ("4", False), (None, True)]
)
def test_the_recorders_span_file_holds_what_the_sdks_holds_for_every_kind_of_value(
    tmp_path, monkeypatch, count_limit, synchronous
):
    if count_limit is not None:  # every span and event over the limit: the SDK's bounded maps
        monkeypatch.setenv("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", count_limit)
        monkeypatch.setenv("OTEL_EVENT_ATTRIBUTE_COUNT_LIMIT", count_limit)
    files = {}
    for use_recorder in (False, True):
        run_dir = tmp_path / str(use_recorder)
        config = TracingConfig(
            "test-engine", run_dir=run_dir, recorder=use_recorder, synchronous=synchronous
        )
        tracing = configure_tracing(config)
        assert tracing is not None
        for request in range(2):
            attributes = {a.REQUEST_IDS: ["r", str(request)]}
            with telemetry.traced(a.REQUEST, attributes=attributes) as root:
                _values(root, mixed=False)
                parent = telemetry.traceparent_of(root)
                for index in range(3):  # children of a remote parent, one linked to it too
                    links = [parent] if index == 1 else []
                    span = telemetry.start_span(f"x.child.{index}", parent=parent, links=links)
                    _values(span, mixed=index == 2)
                    span.end()
        tracing.shutdown()
        files[use_recorder] = _span_file_spans(run_dir)
    assert files[True] == files[False]
    raw = _raw_spans(tmp_path / "True")
    roots = [span["spanId"] for span in raw if span["name"] == a.REQUEST]
    parents = Counter(span["parentSpanId"] for span in raw if span["name"].startswith("x.child"))
    assert parents == {root: 3 for root in roots} and len(roots) == 2  # each under its own
    root = files[True][0]
    kept = {item["key"]: item["value"] for item in root["attributes"]}
    if count_limit is None:
        assert kept["x.strs"] == {"arrayValue": {"values": [{"stringValue": "a"},
                                                            {"stringValue": "b"}]}}  # fmt: skip
        mixed = {item["key"]: item["value"] for item in files[True][-1]["attributes"]}
        assert mixed["x.mixed"]["arrayValue"]["values"] == [{"intValue": "1"}, {"stringValue": "a"}]
    else:
        assert len(kept) == int(count_limit) and root["droppedAttributesCount"] > 0
    children = [span for span in files[True] if span["name"].startswith("x.child")]
    assert sorted(len(span.get("links", [])) for span in children) == [0, 0, 0, 0, 1, 1]
