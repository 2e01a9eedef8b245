"""Span loader throughput: spans/s of ``load_spans`` on span files shaped like a run's.

Writes the spans through the real SDK and file exporter (request spans with cache operation
children, attributes and item events as the connector makes them); the exporter's shutdown
writes the columnar copy beside the JSON lines, as every process of a run does. Then three
readings of the same run directory are interleaved, round by round: ``load_spans`` (the
figure: from the columnar copy, to the full DataFrame), ``load_spans(columnar=False)`` (the
same DataFrame from the OTLP JSON lines) and the baseline, a plain ``json.loads`` pass over
the JSON lines (parsing only, no DataFrame). The replay section's traced run (real spans,
engine and server) is loaded too when it is there, for the detail table.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from testbed.analysis import load_spans
from testbed.bench.config import BenchConfig, SectionResult, Table
from testbed.bench.figures import Figure
from testbed.bench.stats import Ratio, Spread, interleave
from testbed.core import telemetry
from testbed.core.telemetry import SpanKind
from testbed.core.telemetry import attributes as a
from testbed.core.telemetry.setup import TracingConfig, configure_tracing


def write_spans(run_dir: Path, count: int) -> int:
    tracing = configure_tracing(TracingConfig("bench-loader", run_dir=run_dir, run_id="bench"))
    assert tracing is not None
    for index in range(count // 4):
        with telemetry.traced(
            a.REQUEST, attributes={a.REQUEST_ID: f"r{index}", a.PROMPT_TOKENS: 4096}
        ):
            with telemetry.traced(a.CONNECTOR_LOOKUP, kind=SpanKind.CLIENT, attributes={
                a.SESSION_ID: f"e:r{index}", a.TOKENS_REQUESTED: 4096, a.TOKENS_HIT: 2048,
                a.CHUNKS_HIT: 8, a.WAIT_MS: 0.4, a.OK: True}):  # fmt: skip
                pass
            with telemetry.traced(a.CONNECTOR_STORE, kind=SpanKind.CLIENT, attributes={
                a.NUM_REQUESTS: 2, a.REQUEST_IDS: [f"r{index}", f"r{index + 1}"], a.CHUNKS: 8,
                a.BYTES: 262144, a.OK: True, a.COPY_MS: 0.2}) as span:  # fmt: skip
                span.add_event(a.ITEM_EVENT, {a.REQUEST_ID: f"r{index}", a.CHUNKS: 4})
                span.add_event(a.ITEM_EVENT, {a.REQUEST_ID: f"r{index + 1}", a.CHUNKS: 4})
            with telemetry.traced(a.CONNECTOR_END_SESSION, kind=SpanKind.CLIENT, attributes={
                a.SESSION_ID: f"e:r{index}", a.OK: True}):  # fmt: skip
                pass
    return tracing.shutdown()["ended"]


def write_runs(parent: Path, count: int, runs: int) -> int:
    """``runs`` complete run directories under ``parent`` holding ``count`` spans in all."""
    written = 0
    for index in range(runs):
        run_dir = parent / f"run{index:03d}"
        written += write_spans(run_dir, count // runs)
        (run_dir / "summary.json").write_text("{}")  # complete, as far as the loader asks
    return written


def parse_only(directory: Path) -> int:
    count = 0
    for path in directory.glob("**/spans/*.jsonl"):
        with path.open() as lines:
            for line in lines:
                for resource in json.loads(line)["resourceSpans"]:
                    for scope in resource["scopeSpans"]:
                        count += len(scope["spans"])
    return count


def section(config: BenchConfig) -> SectionResult:
    run_dir = config.work_dir / "loader"
    written = write_spans(run_dir, config.loader_spans)
    rounds = 3 if config.quick else 5
    load = interleave(
        {
            "load_spans": lambda: _timed_load(run_dir, written),
            "json_lines": lambda: _timed_load(run_dir, written, columnar=False),
            "json.loads": lambda: _timed_parse(run_dir),
        },
        rounds,
    )
    rates = [written / s for s in load["load_spans"]]
    ratio = Ratio.of(load["json.loads"], load["load_spans"])
    json_lines = Spread.of(load["json_lines"]).median
    figure = Figure(
        "loader_spans_per_s",
        written / Spread.of(load["load_spans"]).median,
        f"spans/s of testbed.analysis.load_spans (files to the whole DataFrame) on {written:,} "
        "spans in one run directory, read from the columnar copy its tracing wrote at "
        f"shutdown; median of {rounds} rounds interleaved with load_spans from the OTLP JSON "
        "lines (same DataFrame) and a json.loads pass over the JSON lines",
        spread=Spread.of(rates),
        details={
            "vs_json_loads": round(ratio.value, 3),
            "json_lines_spans_per_s": round(written / json_lines),
            "spans": written,
        },
    )
    load_rate, parse_rate = written / ratio.denominator.median, written / ratio.numerator.median
    rows = [("synthetic", f"{written:,}", f"{load_rate:,.0f}", f"{written / json_lines:,.0f}",
             f"{parse_rate:,.0f}")]  # fmt: skip
    for real in sorted((config.work_dir / "replay").glob("replay-tracing-on-*"))[:1]:
        spans = len(load_spans(real))
        load_s, json_s = _timed_load(real, spans), _timed_load(real, spans, columnar=False)
        rows.append(("a traced replay run", f"{spans:,}", f"{spans / load_s:,.0f}",
                     f"{spans / json_s:,.0f}", f"{spans / _timed_parse(real):,.0f}"))  # fmt: skip
    table = Table(
        "Span loading",
        ("spans", "count", "load_spans spans/s", "from JSON lines spans/s", "json.loads spans/s"),
        rows,
    )
    return SectionResult([figure], [table])


def _timed_load(directory: Path, expected: int, columnar: bool = True) -> float:
    started = time.perf_counter()
    frame = load_spans(directory, columnar=columnar)
    elapsed = time.perf_counter() - started
    if len(frame) != expected:
        raise RuntimeError(f"load_spans found {len(frame)} spans of {expected}")
    return elapsed


def _timed_parse(directory: Path) -> float:
    started = time.perf_counter()
    parse_only(directory)
    return time.perf_counter() - started
