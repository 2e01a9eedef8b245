"""The columnar span store: written beside the JSON lines at shutdown, loaded to the same
DataFrame, never used when it is not whole, never in the way when it cannot be written."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pandas as pd

from testbed.analysis import load_events, load_spans
from testbed.core import telemetry
from testbed.core.telemetry import SpanKind
from testbed.core.telemetry import attributes as a
from testbed.core.telemetry.setup import SPANS_DIR, TracingConfig, configure_tracing
from testbed.core.telemetry.span_table import columnar_paths

RESOURCE = {"kvcache.chunk_size": 256, "kvcache.mla": False}


def _same_both_ways(run: Path) -> pd.DataFrame:
    spans = load_spans(run)
    pd.testing.assert_frame_equal(spans, load_spans(run, columnar=False))
    pd.testing.assert_frame_equal(load_events(run), load_events(run, columnar=False))
    return spans


def _trace(run_dir: Path, flush_rows: int, requests: int, crashed: Path | None = None) -> Path:
    """Spans with every kind of value the store must type: a key whose type changes between
    flushes, lists (empty ones too), bytes, errors, links and events. ``crashed``: also copy
    the run as a process that never shut down would leave it (flushed, not closed)."""
    tracing = configure_tracing(TracingConfig("kvtb-engine", run_dir=run_dir, resource=RESOURCE))
    assert tracing is not None
    exporter = tracing.exporters["file"].inner
    exporter._columnar.flush_rows = flush_rows  # several segments, with different schemas
    for index in range(requests):
        changing = index if index < requests // 2 else f"late-{index}"  # int, then str
        with telemetry.traced(
            a.REQUEST, attributes={a.REQUEST_ID: f"r{index}", "x.changing": changing}
        ) as request:
            parent = telemetry.traceparent_of(request)
            with telemetry.traced(a.CONNECTOR_STORE, kind=SpanKind.CLIENT, links=[parent],
                attributes={a.REQUEST_IDS: [f"r{index}", "s"], a.WAIT_MS: 0.25 * index,
                            "x.empty": [], "x.bytes": b"\x01\xff", "x.ints": [index, 2],
                            a.OK: index % 3 != 0}) as store:  # fmt: skip
                store.add_event(a.ITEM_EVENT, {a.REQUEST_ID: f"r{index}", a.CHUNKS: index})
                if index % 4 == 0:
                    telemetry.fail(store, "no room")
        if index % 3 == 2:
            tracing.force_flush()  # batches of 6 spans: a segment of the copy every 2nd one
    span_file = exporter.path
    (run_dir / "summary.json").write_text("{}")
    if crashed is not None:
        tracing.force_flush()
        shutil.copytree(run_dir, crashed)
    tracing.shutdown()
    return span_file


def test_a_traced_replay_sweep_loads_the_same_from_its_columnar_copies(small_sweep):
    """Every process of real runs (engine, TP workers, cache server) left a whole columnar copy,
    and the sweep loads from them exactly as from the JSON lines."""
    files = sorted(small_sweep.glob(f"*/{SPANS_DIR}/*.jsonl"))
    services = {path.name.rsplit("-", 1)[0] for path in files}
    assert {"kvtb-engine", "kvtb-server"} <= services
    assert all(columnar_paths(path)[0].is_file() for path in files)
    spans = _same_both_ways(small_sweep)
    assert len(spans) > 100 and spans[a.REQUEST_IDS].notna().any()
    assert spans.groupby("run_id")["start_time"].is_monotonic_increasing.all()


def test_typed_columns_segments_and_mixed_types_load_the_same(tmp_path):
    span_file = _trace(tmp_path / "run", flush_rows=8, requests=20)
    assert columnar_paths(span_file)[0].is_file()  # whole, so loaded from it
    spans = _same_both_ways(tmp_path / "run")
    assert len(spans) == 40
    store = spans[spans["name"] == a.CONNECTOR_STORE]
    requests = spans[spans["name"] == a.REQUEST]
    assert requests["x.changing"].tolist()[:2] == [0, 1]
    assert requests["x.changing"].tolist()[-1] == "late-19"
    assert all(value == [] for value in store["x.empty"])
    assert set(store["x.bytes"]) == {"01ff"}
    first = spans[(spans["name"] == a.CONNECTOR_STORE)].iloc[0]
    assert first[a.REQUEST_IDS] == ["r0", "s"] and first["x.ints"] == [0, 2]
    assert first["status"] == "ERROR" and first["status_message"] == "no room"
    assert len(first["links"]) == 1 and str(spans[a.WAIT_MS].dtype) == "float64"
    assert str(spans[a.OK].dtype) == "boolean"
    assert len(load_events(tmp_path / "run")) == 20


def test_a_process_that_did_not_shut_down_or_a_damaged_copy_loads_from_json_lines(tmp_path):
    whole = _trace(tmp_path / "whole", flush_rows=8, requests=6, crashed=tmp_path / "crashed")
    crashed = tmp_path / "crashed" / SPANS_DIR / whole.name
    assert crashed.is_file() and not columnar_paths(crashed)[0].exists()
    assert columnar_paths(whole)[0].is_file()
    pd.testing.assert_frame_equal(load_spans(tmp_path / "crashed"), load_spans(tmp_path / "whole"))
    spans_path = columnar_paths(whole)[0]
    expected = load_spans(tmp_path / "whole", columnar=False)
    spans_path.write_bytes(spans_path.read_bytes()[: spans_path.stat().st_size // 2])
    pd.testing.assert_frame_equal(load_spans(tmp_path / "whole"), expected)


def test_a_copy_that_cannot_be_written_leaves_the_json_lines_whole(tmp_path, caplog):
    span_dir = tmp_path / "run" / SPANS_DIR
    span_dir.mkdir(parents=True)
    spans_path = columnar_paths(span_dir / f"kvtb-engine-{os.getpid()}.jsonl")[0]
    # The writer's scratch file name is taken by a directory: the copy cannot be made.
    spans_path.with_name(spans_path.name + ".part").mkdir()
    span_file = _trace(tmp_path / "run", flush_rows=8, requests=5)
    assert not spans_path.exists() and "no columnar span copy" in caplog.text
    counts = json.loads(span_file.with_suffix(".counts.json").read_text())
    assert counts["exporters"]["file"] == {"exported": 10, "failed": 0, "dropped": 0}
    assert len(load_spans(tmp_path / "run")) == 10


def test_the_copy_is_compressed_when_asked_and_loads_the_same(tmp_path, monkeypatch):
    sizes = {}
    for codec in ("none", "zstd"):
        monkeypatch.setenv("KVTB_SPAN_COMPRESSION", codec)
        span_file = _trace(tmp_path / codec, flush_rows=256, requests=400)
        sizes[codec] = columnar_paths(span_file)[0].stat().st_size
        assert len(_same_both_ways(tmp_path / codec)) == 800
    assert sizes["zstd"] < sizes["none"] / 3  # the columns repeat
