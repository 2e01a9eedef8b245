"""Span loader throughput: spans/s of ``load_spans`` on span files shaped like a run's.

Writes the spans through the real SDK and file exporter (request spans with cache operation
children, attributes and item events as the connector makes them); the exporter's shutdown
writes the columnar copy beside the JSON lines, as every process of a run does. Then three
readings of the same run directory are interleaved, round by round: ``load_spans`` (the
figure: from the columnar copy, to the full DataFrame), ``load_spans(columnar=False)`` (the
same DataFrame from the OTLP JSON lines) and the baseline, a plain ``json.loads`` pass over
the JSON lines (parsing only, no DataFrame). The replay section's traced runs (real spans of
the engine and the server, every attribute column a replay writes) are read the same three
ways in the same rounds when they are there: the figure's ``real_spans_per_s`` and the table's
second row.
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
from testbed.core.run_dir import RunDir
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
        RunDir(run_dir).summary.write_text("{}")  # complete, as far as the loader asks
    return written


def parse_only(directory: Path) -> int:
    count = 0
    # A run directory or a directory of them (which may be links).
    for path in [*directory.glob("spans/*.jsonl"), *directory.glob("*/spans/*.jsonl")]:
        with path.open() as lines:
            for line in lines:
                for resource in json.loads(line)["resourceSpans"]:
                    for scope in resource["scopeSpans"]:
                        count += len(scope["spans"])
    return count


def section(config: BenchConfig) -> SectionResult:
    run_dir = config.work_dir / "loader"
    written = write_spans(run_dir, config.loader_spans)
    real_dir, real_spans = _real_runs(config.work_dir / "replay")
    rounds = 3 if config.quick else 5
    cells = {
        "load_spans": lambda: _timed_load(run_dir, written),
        "json_lines": lambda: _timed_load(run_dir, written, columnar=False),
        "json.loads": lambda: _timed_parse(run_dir),
    }
    if real_spans:
        cells["real load_spans"] = lambda: _timed_load(real_dir, real_spans)
        cells["real json_lines"] = lambda: _timed_load(real_dir, real_spans, columnar=False)
        cells["real json.loads"] = lambda: _timed_parse(real_dir)
    load = interleave(cells, rounds)
    rates = [written / s for s in load["load_spans"]]
    ratio = Ratio.of(load["json.loads"], load["load_spans"])
    json_lines = Spread.of(load["json_lines"]).median
    details: dict[str, float | int] = {
        "vs_json_loads": round(ratio.value, 3),
        "json_lines_spans_per_s": round(written / json_lines),
        "spans": written,
    }
    if real_spans:
        details["real_spans"] = real_spans
        details["real_spans_per_s"] = round(real_spans / Spread.of(load["real load_spans"]).median)
    figure = Figure(
        "loader_spans_per_s",
        written / Spread.of(load["load_spans"]).median,
        f"spans/s of testbed.analysis.load_spans (files to the whole DataFrame) on {written:,} "
        "spans in one run directory, read from the columnar copy its tracing wrote at "
        f"shutdown; median of {rounds} rounds interleaved with load_spans from the OTLP JSON "
        "lines (same DataFrame), a json.loads pass over the JSON lines, and the same three "
        "over the replay section's traced runs (real spans of the engine and the server)",
        spread=Spread.of(rates),
        details=details,
    )
    rows = [_row("synthetic, one process", written, load, "")]
    if real_spans:
        runs = len(list(real_dir.iterdir()))
        rows.append(_row(f"the replay section's {runs} traced runs", real_spans, load, "real "))
    table = Table(
        f"Span loading (median of {rounds} interleaved rounds)",
        ("spans", "count", "load_spans spans/s", "from JSON lines spans/s", "json.loads spans/s"),
        rows,
    )
    return SectionResult([figure], [table])


def _row(what: str, spans: int, load: dict[str, list[float]], prefix: str) -> tuple[str, ...]:
    def rate(cell: str) -> str:
        return f"{spans / Spread.of(load[prefix + cell]).median:,.0f}"

    return (what, f"{spans:,}", rate("load_spans"), rate("json_lines"), rate("json.loads"))


def _real_runs(replay_dir: Path) -> tuple[Path, int]:
    """A directory of the replay section's traced runs (links to them, each marked complete
    for the loader) and how many spans they hold; 0 spans when there are none."""
    real_dir = replay_dir.parent / "loader-real"
    traced = sorted(replay_dir.glob("*tracing-on-*"))
    if not traced:
        return real_dir, 0
    real_dir.mkdir(parents=True, exist_ok=True)
    for run in traced:
        RunDir(run).summary.write_text("{}")  # complete, as far as the loader asks
        link = real_dir / run.name
        if not link.exists():
            link.symlink_to(run.resolve(), target_is_directory=True)
    return real_dir, len(load_spans(real_dir))


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
