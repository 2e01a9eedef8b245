"""Tracing overhead per cache operation (on vs off, same run) and span loader throughput.

Two servers run side by side, one with tracing off (``OTEL_SDK_DISABLED=true``) and one
writing span files; rounds alternate between "off" (client tracing off, untraced server) and
"on" (client spans to a file, traced server), so machine noise hits both alike. Each round
times the client-side calls of one cache cycle: lookup, store, retrieve (begin, copy, end),
lock release and end of session. (Loader throughput: ``benchmarks.loader``.)

    python -m benchmarks.tracing_overhead [--rounds 200]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from benchmarks.common import median_ms, spread, table
from testbed import telemetry
from testbed.launch import ServerProcess
from testbed.telemetry.setup import TracingConfig, configure_tracing
from tests.support.cache_harness import BLOCK_SIZE, Harness

C = 256
OPS = ("lookup", "store", "retrieve", "lock_release", "end_session")


def cycle(h: Harness, index: int, samples: dict[str, list[float]]) -> None:
    tokens = [(index * 7919 + 31 * i) % 30_000 for i in range(4 * C + 3)]
    blocks = list(range(4 * C // BLOCK_SIZE + 1))
    started = time.perf_counter()
    h.matched(f"miss{index}", tokens)
    samples["lookup"].append(time.perf_counter() - started)
    h.side.update_state_after_alloc(f"miss{index}", blocks, 0)
    plan = h.compute(f"miss{index}", 0, len(tokens), blocks, True)
    started = time.perf_counter()
    h.store(plan)
    samples["store"].append(time.perf_counter() - started)
    started = time.perf_counter()
    h.side.request_finished(f"miss{index}")
    samples["end_session"].append(time.perf_counter() - started)
    h.matched(f"hit{index}", tokens, engine_hit=C)
    started = time.perf_counter()
    h.side.update_state_after_alloc(f"hit{index}", [b + 40 for b in blocks], 3 * C)  # frees chunk 0
    samples["lock_release"].append(time.perf_counter() - started)
    plan = h.side.build_plan([])
    started = time.perf_counter()
    h.load(plan)
    samples["retrieve"].append(time.perf_counter() - started)
    h.side.request_finished(f"hit{index}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvtb-bench-"))
    off_env = {"OTEL_SDK_DISABLED": "true"}
    common = ["--chunk-size", str(C), "--capacity", "1GiB"]
    with (
        ServerProcess(common, env=off_env) as off_server,
        ServerProcess([*common, "--run-dir", str(work)]) as on_server,
    ):
        tracing = configure_tracing(TracingConfig("bench-engine", run_dir=work))
        assert tracing is not None
        samples: dict[str, dict[str, list[float]]] = {
            mode: {op: [] for op in OPS} for mode in ("off", "on")
        }
        with (
            Harness(off_server, chunk_size=C, num_blocks=256) as off,
            Harness(on_server, chunk_size=C, num_blocks=256) as on,
        ):
            for index in range(args.rounds):
                telemetry.use_provider(None)
                cycle(off, index, samples["off"])
                telemetry.use_provider(tracing.provider)
                cycle(on, index, samples["on"])
        counts = tracing.shutdown()
    rows = []
    for op in OPS:
        off_ms, on_ms = median_ms(samples["off"][op]), median_ms(samples["on"][op])
        rows.append(
            (
                op,
                f"{off_ms:.3f}",
                spread(samples["off"][op]),
                f"{on_ms:.3f}",
                spread(samples["on"][op]),
                f"{on_ms - off_ms:+.3f}",
                f"{on_ms / off_ms:.2f}x",
            )
        )
    print(f"tracing overhead per operation, {args.rounds} alternating rounds (client-side ms)")
    print(table(rows, ("op", "off p50", "off IQR", "on p50", "on IQR", "delta", "ratio")))
    print(
        f"spans written by the client: {counts['ended']} "
        f"(dropped {counts['exporters']['file']['dropped']})"
    )


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
