"""A span's cost per operation on the request path: the recorder against the SDK's provider.

``python -m testbed.bench.span_cost [--ops N] [--rounds R]`` times ``N`` operations shaped as a
cache operation is traced (``traced`` with six attributes, two more set inside, the current
span read once, as ``inject`` does) with tracing off, with the SDK's own tracer provider and
with the span recorder (:mod:`testbed.core.telemetry.recorder`), both exporting to a span file
and its columnar copy on their own threads, as in a run; rounds alternate the three. Prints
the median µs per operation and each one's cost over tracing off (goal: ≤ 10 µs for the
recorder). The export itself (building OTLP spans and writing them) runs off the request path
and is timed apart: seconds from the last operation to the end of the shutdown.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from testbed.core import telemetry
from testbed.core.telemetry import SpanKind
from testbed.core.telemetry import attributes as a
from testbed.core.telemetry.setup import TracingConfig, configure_tracing

MODES = ("off", "sdk", "recorder")


def operations(count: int) -> float:
    """Seconds for ``count`` traced operations (the loop's own work included)."""
    started = time.perf_counter()
    for index in range(count):
        with telemetry.traced(a.CONNECTOR_STORE, kind=SpanKind.CLIENT, attributes={
            a.NUM_REQUESTS: 1, a.CHUNKS: 4, a.TOKENS: 1024, a.BLOCKS: 64,
            a.BYTES: 262144, a.SESSION_ID: "engine:r"}) as span:  # fmt: skip
            telemetry.inject()
            span.set_attributes({a.OK: True, a.COPY_MS: 0.1 * (index & 7)})
    return time.perf_counter() - started


def one_round(mode: str, count: int, work: Path) -> tuple[float, float]:
    """(µs per operation, seconds of the export after the last operation) of one mode."""
    tracing = None
    if mode != "off":
        tracing = configure_tracing(
            TracingConfig(f"bench-{mode}", run_dir=work / mode, recorder=mode == "recorder")
        )
    try:
        seconds = operations(count)
    finally:
        drained = time.perf_counter()
        if tracing is not None:
            counts = tracing.shutdown()
            if counts["exporters"]["file"]["dropped"]:
                raise RuntimeError(f"{mode}: spans dropped: {counts}")
        drained = time.perf_counter() - drained
    return seconds / count * 1e6, drained


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    per_op: dict[str, list[float]] = {m: [] for m in MODES}
    export_s: dict[str, list[float]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="kvtb-span-cost-") as scratch:
        for index in range(args.rounds):
            for mode in MODES:
                micros, drained = one_round(mode, args.ops, Path(scratch) / str(index))
                per_op[mode].append(micros)
                export_s[mode].append(drained)
    off = statistics.median(per_op["off"])
    print(f"{args.ops} operations x {args.rounds} alternating rounds")
    print(f"{'mode':<10}{'µs/op p50':>12}{'over off µs':>14}{'export after s':>16}")
    for mode in MODES:
        median = statistics.median(per_op[mode])
        print(
            f"{mode:<10}{median:>12.2f}{median - off:>14.2f}"
            f"{statistics.median(export_s[mode]):>16.3f}"
        )


if __name__ == "__main__":
    main()
