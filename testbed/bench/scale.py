"""Scale: runs of a million requests, a 16-instance fleet and a corpus 30 times the shared one.

Three workloads, each a ``kvtb`` command in a process group of its own, timed from its start to
its exit; its peak memory is the larger of what Linux reports to ``wait4`` (the command and
the children it waited for) and the largest sum of the resident sets of the command and all
its descendants, its cache server included, sampled as it runs
(:mod:`testbed.bench.peak_memory`):

- ``1m``: a generated chat workload of :attr:`BenchConfig.scale_requests` requests (1,000,000)
  through the metadata-only replay (``kvtb run --metadata-only``: vLLM's scheduler, the
  connector and the cache server, no KV bytes; spans and the chunk log written as always);
- ``fleet16``: the whole Mooncake conversation trace on a 16-instance fleet sharing one cache
  server, metadata only;
- ``agentic``: the block-key oracle (``kvtb run --engine oracle``, LRU at a capacity) and the
  what-if (``kvtb whatif``: LRU curves at every capacity, Belady beside them) over the shared
  kv-cache-tester corpus repeated :attr:`BenchConfig.scale_copies` times under new ids
  (``--workload-param copies=30``).

Each reports its wall time, requests per second and peak memory. ``--quick`` runs the same
commands on small sizes (the figures then mean nothing). A command that fails is reported with
the last lines of its log.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from testbed.bench.config import BenchConfig, SectionResult, Table, find_trace
from testbed.bench.figures import Figure
from testbed.bench.peak_memory import TreePeak
from testbed.core.process_groups import start_group, stop_group

AGENTIC_DIR = Path("kv-cache-tester")
"""The shared agentic corpus, beside the Mooncake trace's directory."""
_KVTB = [sys.executable, "-m", "testbed.cli"]


@dataclass(frozen=True)
class Measured:
    """One command's wall time, requests and peak resident memory."""

    name: str
    wall_s: float
    requests: int | None
    peak_rss_bytes: int

    @property
    def requests_per_s(self) -> float | None:
        return self.requests / self.wall_s if self.requests and self.wall_s > 0 else None


def measure(name: str, command: list[str], log_path: Path, requests: int | None) -> Measured:
    """Runs ``command`` in a process group of its own; ``RuntimeError`` with its log's tail
    when it fails. Interrupted, it stops the group."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        started = time.perf_counter()
        process = start_group(
            command, die_with_parent=True, stdout=log, stderr=subprocess.STDOUT, text=True
        )
        try:
            with TreePeak(process.pid) as tree:
                _, status, usage = os.wait4(process.pid, 0)
        except BaseException:
            stop_group(process, 30.0)
            raise
        wall_s = time.perf_counter() - started
        process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        tail = log_path.read_text(errors="replace").strip()[-1500:]
        raise RuntimeError(f"{name}: {' '.join(command[2:])} exited {process.returncode}: {tail}")
    return Measured(name, wall_s, requests, max(usage.ru_maxrss * 1024, tree.peak_bytes))


def _run(config: BenchConfig, name: str, flags: list[str]) -> list[str]:
    out = config.work_dir / "scale" / name
    return [*_KVTB, "run", *flags, "--out", str(out), "--no-progress"]


def one_million(config: BenchConfig) -> Measured:
    requests = config.scale_requests
    flags = ["--workload", "chat", "--requests", str(requests), "--metadata-only"]
    command = _run(config, "1m", flags)
    return measure("1m", command, config.work_dir / "scale" / "1m.log", requests)


def fleet16(config: BenchConfig) -> Measured:
    trace = find_trace(config).resolve()
    requests = config.scale_fleet_requests
    flags = ["--engine", "fleet", "--workload", f"mooncake:{trace}", "--instances", "16",
             "--metadata-only",
             "--requests", "none" if requests is None else str(requests)]  # fmt: skip
    command = _run(config, "fleet16", flags)
    return measure("fleet16", command, config.work_dir / "scale" / "fleet16.log", requests)


def agentic_params(config: BenchConfig) -> list[str]:
    params = [f"copies={config.scale_copies}"]
    if config.quick:
        params += ["max_sessions=2", "max_input_tokens=20000"]
    return [flag for param in params for flag in ("--workload-param", param)]


def agentic(config: BenchConfig) -> tuple[Measured, Measured]:
    """The oracle and the what-if over the repeated corpus."""
    corpus = (find_trace(config).resolve().parents[1] / AGENTIC_DIR).resolve()
    workload = ["--workload", f"agentic:{corpus}", "--requests", "none", *agentic_params(config)]
    work = config.work_dir / "scale"
    oracle = measure(
        "agentic oracle",
        _run(config, "agentic-oracle", ["--engine", "oracle", *workload]),
        work / "agentic-oracle.log",
        None,
    )
    whatif = measure(
        "agentic what-if",
        [*_KVTB, "whatif", *workload, "--out", str(work / "agentic-whatif")],
        work / "agentic-whatif.log",
        None,
    )
    requests = _oracle_requests(work / "agentic-oracle")
    return (
        Measured(oracle.name, oracle.wall_s, requests, oracle.peak_rss_bytes),
        Measured(whatif.name, whatif.wall_s, requests, whatif.peak_rss_bytes),
    )


def _oracle_requests(out: Path) -> int | None:
    """Requests the oracle run served (its ``summary.json``)."""
    import json

    for path in out.rglob("summary.json"):
        requests = json.loads(path.read_text()).get("requests")
        return int(requests) if requests is not None else None
    return None


def section(config: BenchConfig) -> SectionResult:
    million = one_million(config)
    fleet = fleet16(config)
    oracle, whatif = agentic(config)
    size = "quick sizes: the figures mean nothing" if config.quick else None
    figures = [
        Figure("scale_1m_wall_s", million.wall_s, _what(million, "metadata-only replay"),
               note=size),
        Figure("scale_1m_peak_rss_bytes", float(million.peak_rss_bytes),
               _what(million, "peak RSS of the metadata-only replay"), note=size),
        Figure("scale_fleet16_wall_s", fleet.wall_s, _what(fleet, "16-instance fleet"), note=size),
        Figure("scale_agentic_whatif_wall_s", whatif.wall_s, _what(whatif, "kvtb whatif"),
               details={"oracle_wall_s": round(oracle.wall_s, 1)}, note=size),
        Figure("scale_agentic_peak_rss_bytes",
               float(max(oracle.peak_rss_bytes, whatif.peak_rss_bytes)),
               "the larger peak RSS of the agentic oracle and what-if",
               details={"oracle": oracle.peak_rss_bytes, "whatif": whatif.peak_rss_bytes},
               note=size),
    ]  # fmt: skip
    return SectionResult(figures, [_table(config, (million, fleet, oracle, whatif))])


def _table(config: BenchConfig, runs: tuple[Measured, ...]) -> Table:
    rows = [
        (m.name, f"{m.requests or '—'}", f"{m.wall_s:.1f}",
         f"{m.requests_per_s:,.0f}" if m.requests_per_s else "—",
         f"{m.peak_rss_bytes / 2**30:.2f}")
        for m in runs
    ]  # fmt: skip
    fleet = config.scale_fleet_requests
    own_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return Table(
        "Scale: wall time, throughput and peak memory",
        ("run", "requests", "wall s", "requests/s", "peak RSS GiB"),
        rows,
        f"{config.scale_requests:,} chat requests; the fleet over "
        f"{'the whole trace' if fleet is None else f'{fleet} requests'}; the agentic corpus "
        f"x{config.scale_copies}; this process's own peak {own_gib:.2f} GiB",
    )


def _what(measured: Measured, what: str) -> str:
    rate = measured.requests_per_s
    per_s = f", {rate:,.0f} requests/s" if rate else ""
    return f"{what}: {measured.requests or 'all'} requests in {measured.wall_s:.1f} s{per_s}"
