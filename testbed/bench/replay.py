"""Replay against vLLM's scheduler alone, with tracing on and off, and metadata only.

Five cells over the same first requests of the Mooncake conversation trace, interleaved
round by round (each cell a fresh engine and, where it has one, a fresh cache server;
building them is outside the timing): vLLM's v1 ``Scheduler`` alone (no connector, no worker
harness, no KV: what any scheduler-level simulation pays), the replay with tracing on (span
files from the engine and the server, as ``kvtb run`` writes them; the exporters' final flush
is timed too), the same with tracing off (``OTEL_SDK_DISABLED=true`` in the server, no
provider in the engine), metadata only with tracing on (the server keeps no KV bytes,
the harness writes none), and spans without the server's chunk log (``--no-chunk-log``: the
log's own cost is the tracing-on cell over this one). Each cell times ``ReplayEngine.run``:
every request from arrival to its last token, on the virtual clock's order, as fast as this
machine goes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from testbed.bench.config import BenchConfig, SectionResult, Table, find_trace
from testbed.bench.figures import Figure
from testbed.bench.stats import Ratio, Spread, interleave
from testbed.core.run_dir import RunDir

if TYPE_CHECKING:
    from testbed.engine.replay import ReplaySpec
    from testbed.workloads import WorkloadRequest

CHUNK_SIZE = 512
CAPACITY = "2GiB"
WARMUP_REQUESTS = 8
CELLS = (
    "scheduler alone",
    "replay, tracing on",
    "replay, tracing off",
    "metadata only, tracing on",
    "replay, spans without the chunk log",
)


def section(config: BenchConfig) -> SectionResult:
    from testbed.engine.replay import ReplaySpec
    from testbed.run import max_model_len
    from testbed.workloads import make_workload

    trace = find_trace(config)
    requests = list(
        make_workload(f"mooncake:{trace}", num_requests=config.replay_size, max_output_tokens=16)
    )
    spec = ReplaySpec.of(
        chunk_size=CHUNK_SIZE,
        engine_blocks=8192,
        max_model_len=max_model_len(requests, 64),
        time_profile="flat",
        engine_id="bench",
    )
    work = config.work_dir / "replay"
    integrity: dict[str, int] = {}
    counter = iter(range(10**6))

    def cell(
        name: str, traced: bool, metadata_only: bool, chunk_log: bool = True
    ) -> Callable[[], float]:
        def measure() -> float:
            run_dir = work / f"{name.replace(' ', '-').replace(',', '')}-{next(counter)}"
            result = _replay(spec, requests, run_dir, traced, metadata_only, chunk_log)
            integrity[name] = integrity.get(name, 0) + result[1]
            return result[0]

        return measure

    cells = {
        CELLS[0]: lambda: _scheduler_alone(spec, requests),
        CELLS[1]: cell(CELLS[1], traced=True, metadata_only=False),
        CELLS[2]: cell(CELLS[2], traced=False, metadata_only=False),
        CELLS[3]: cell(CELLS[3], traced=True, metadata_only=True),
        CELLS[4]: cell(CELLS[4], traced=True, metadata_only=False, chunk_log=False),
    }
    rounds = config.replay_rounds
    warm = requests[:WARMUP_REQUESTS]  # first-use costs (imports, vLLM's set-up) out of round 1
    _scheduler_alone(spec, warm)
    _replay(spec, warm, work / "warm-up", traced=True, metadata_only=False)
    samples = interleave(cells, rounds, on_round=lambda i: _progress(i + 1, rounds))
    tokens = sum(len(r.prompt_token_ids) for r in requests)
    size = f"{len(requests):,} requests of the Mooncake conversation trace ({tokens / 1e6:.1f}M "
    size += f"prompt tokens, chunk {CHUNK_SIZE}, interleaved rounds: {rounds})"
    return _report(samples, integrity, len(requests), size)


def _report(
    samples: dict[str, list[float]], integrity: dict[str, int], num_requests: int, size: str
) -> SectionResult:
    bare, on, off, meta, spans_only = (samples[name] for name in CELLS)
    what = "wall time of {}, " + size
    figures = [
        Figure.of(
            "replay_vs_bare_scheduler",
            Ratio.of(on, bare),
            what.format("the replay with tracing on over vLLM's scheduler alone"),
            details={"integrity_errors": integrity},
        ),
        Figure.of(
            "replay_metadata_only_vs_bare_scheduler",
            Ratio.of(meta, bare),
            what.format("the metadata-only replay (tracing on) over the scheduler alone"),
        ),
        Figure.of(
            "tracing_overhead",
            Ratio.of(on, off),
            what.format(
                "the replay with tracing on (spans and the server's chunk log) over the same "
                "with tracing off"
            ),
        ),
        Figure.of(
            "spans_overhead",
            Ratio.of(spans_only, off),
            what.format(
                "the replay with spans but no chunk log (kvtb server --no-chunk-log) over the "
                "same with tracing off"
            ),
        ),
        Figure.of(
            "chunk_log_overhead",
            Ratio.of(on, spans_only),
            what.format("the replay with tracing on over the same without the chunk log"),
        ),
    ]
    rows = []
    for name, values in samples.items():
        spread = Spread.of(values)
        rows.append(
            (name, f"{spread.min:.2f}", f"{spread.median:.2f}", f"{spread.max:.2f}",
             f"{num_requests / spread.median:,.0f}", integrity.get(name, "–"))
        )  # fmt: skip
    header = ("cell", "min s", "median s", "max s", "requests/s", "integrity errors")
    return SectionResult(figures, [Table("Replay cells", header, rows, size)])


def _scheduler_alone(spec: ReplaySpec, requests: list[WorkloadRequest]) -> float:
    from testbed.engine.replay import ReplayEngine

    with ReplayEngine(spec, None) as engine:
        return engine.run(requests).wall_s


def _replay(
    spec: ReplaySpec,
    requests: list[WorkloadRequest],
    run_dir: Path,
    traced: bool,
    metadata_only: bool,
    chunk_log: bool = True,
) -> tuple[float, int]:
    """Seconds of one replay run (and of its exporters' final flush) and its integrity errors."""
    import dataclasses
    import time

    from server.launch import ServerProcess
    from testbed.core import telemetry
    from testbed.core.credentials import ServerEndpoint
    from testbed.core.telemetry.setup import TracingConfig, configure_tracing
    from testbed.engine.replay import ReplayEngine

    run_dir.mkdir(parents=True, exist_ok=True)
    args = ["--chunk-size", str(CHUNK_SIZE), "--capacity", CAPACITY]
    args += ["--run-dir", str(run_dir)] if traced else []
    args += ["--metadata-only"] if metadata_only else []
    args += [] if chunk_log else ["--no-chunk-log"]
    env = None if traced else {"OTEL_SDK_DISABLED": "true"}
    replay_spec = dataclasses.replace(
        spec, run=dataclasses.replace(spec.run, metadata_only=metadata_only)
    )
    with ServerProcess(args, env=env, log_path=RunDir(run_dir).server_log()) as server:
        tracing = (
            configure_tracing(TracingConfig("kvtb-engine", run_dir=run_dir)) if traced else None
        )
        if not traced:
            telemetry.use_provider(None)
        endpoint = ServerEndpoint(server.url, server.token)
        with ReplayEngine(replay_spec, endpoint, work_dir=run_dir) as engine:
            result = engine.run(requests)
            started = time.perf_counter()
            if tracing is not None:
                tracing.shutdown()
            return result.wall_s + time.perf_counter() - started, result.integrity_errors


def _progress(done: int, rounds: int) -> None:
    print(f"  replay: round {done}/{rounds}", file=sys.stderr, flush=True)
