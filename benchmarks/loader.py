"""Span loader throughput: spans/s of ``load_spans`` on span files shaped like a run's.

Writes ``--spans`` spans through the real SDK and file exporter (request spans with cache
operation children, attributes and item events as the connector makes them), then loads
them back ``--repeat`` times. The baseline is a plain ``json.loads`` pass over the same
files (just parsing, no DataFrame), measured in the same run. With ``--runs N`` the spans are
spread over N complete run directories under one parent, loaded in one call as a sweep is.

    python -m benchmarks.loader [--spans 200000] [--runs 1]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from testbed import telemetry
from testbed.analysis import load_spans
from testbed.telemetry import SpanKind
from testbed.telemetry import attributes as a
from testbed.telemetry.setup import TracingConfig, configure_tracing


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spans", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--runs", type=int, default=1, help="run directories (1: a single run)")
    args = parser.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="kvtb-loader-"))
    if args.runs == 1:
        written = write_spans(run_dir, args.spans)
    else:
        written = write_runs(run_dir, args.spans, args.runs)
    size = sum(p.stat().st_size for p in run_dir.glob("**/spans/*.jsonl"))
    loader, baseline = [], []
    for _ in range(args.repeat):
        started = time.perf_counter()
        frame = load_spans(run_dir)
        loader.append(time.perf_counter() - started)
        started = time.perf_counter()
        parsed = parse_only(run_dir)
        baseline.append(time.perf_counter() - started)
    assert len(frame) == parsed == written
    load_s, parse_s = sorted(loader)[len(loader) // 2], sorted(baseline)[len(baseline) // 2]
    print(
        f"{written:,} spans in {args.runs} run(s), {size / 2**20:.1f} MiB of OTLP JSON lines, "
        f"{len(frame.columns)} columns"
    )
    print(f"load_spans (DataFrame)  median {load_s:.3f} s  {written / load_s:>12,.0f} spans/s")
    print(f"json.loads only         median {parse_s:.3f} s  {written / parse_s:>12,.0f} spans/s")
    print(f"ratio load_spans / json.loads: {parse_s / load_s:.2f}x the throughput")


if __name__ == "__main__":
    main()
