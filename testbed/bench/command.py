"""``kvtb bench [--quick] [--peer] --out DIR``: every benchmark, one report.

Runs the sections of :data:`SECTIONS` in order (one line each on stderr as it starts and
ends), each inside a :class:`~testbed.bench.machine.LoadWatch`, then writes
``DIR/results.json`` and ``DIR/BENCHMARKS.md`` (:mod:`testbed.bench.report`). A section that
fails is reported with its keys empty and the reason; the others still run. Exit status: 0
when every section ran, 1 when one failed, 2 for bad input (nothing run). Ctrl-C stops every
process the bench started and removes their shared-memory files (each section's context
managers do) and writes nothing.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from testbed.bench.config import BenchConfig, SectionResult, find_trace
from testbed.bench.figures import missing
from testbed.bench.machine import LoadWatch, machine, versions
from testbed.commands.only_flag import add_only_argument, picked


@dataclass(frozen=True)
class Section:
    module: str
    """The module under ``testbed.bench`` whose ``section(config)`` runs it (imported only
    when it runs: torch and vLLM load late)."""
    keys: tuple[str, ...]
    """The figures it reports (emptied, with the reason, when it fails)."""
    peer_only: bool = False
    """Runs only with ``--peer``."""

    def wanted(self, config: BenchConfig) -> bool:
        return config.peer or not self.peer_only

    def run(self, config: BenchConfig) -> SectionResult:
        module = importlib.import_module(f"testbed.bench.{self.module}")
        result: SectionResult = module.section(config)
        return result


SECTIONS: dict[str, Section] = {
    "replay": Section(
        "replay",
        (
            "replay_vs_bare_scheduler",
            "replay_metadata_only_vs_bare_scheduler",
            "tracing_overhead",
            "spans_overhead",
            "chunk_log_overhead",
        ),
    ),
    "loader": Section("loader", ("loader_spans_per_s",)),
    "ops": Section("ops", ("store_vs_memcpy", "retrieve_vs_memcpy")),
    "vllm": Section(
        "e2e",
        (
            "rpc_round_trip_ms",
            "rpc_transit_ms",
            "first_pass_vs_recompute_1k",
            "first_pass_mirror_vs_recompute_1k",
            "first_pass_mirror_vs_recompute_4k",
            "first_pass_mirror_vs_recompute_16k",
            "hit_1k_vs_recompute",
            "hit_4k_vs_recompute",
            "hit_16k_vs_recompute",
            "hit_1k_over_prefix_cache_ms",
        ),
    ),
    "peer_servers": Section(
        "peer.alone",
        ("lookup_vs_lmcache", "store_vs_lmcache", "retrieve_vs_lmcache"),
        peer_only=True,
    ),
    "tiers": Section(
        "tiers", ("disk_tier_write_vs_dd", "disk_tier_read_vs_dd", "promotion_vs_memcpy")
    ),
    "others": Section("others", ()),
    "scale": Section(
        "scale",
        (
            "scale_1m_wall_s",
            "scale_1m_peak_rss_bytes",
            "scale_fleet16_wall_s",
            "scale_agentic_whatif_wall_s",
            "scale_agentic_peak_rss_bytes",
        ),
    ),
    # A GPU section goes here (store/retrieve bandwidth on the device against its own
    # copies): a module with section(config), run when torch.cuda.is_available().
}
"""The sections in the order they run (``replay`` first: ``loader`` also loads its spans)."""


def add_bench_parser(commands: Any) -> None:
    bench = commands.add_parser(
        "bench", help="every benchmark, ratios measured side by side → results.json, BENCHMARKS.md"
    )
    bench.add_argument("--out", type=Path, required=True, help="where the report goes")
    bench.add_argument("--quick", action="store_true", help="small sizes everywhere (the tests)")
    bench.add_argument(
        "--peer",
        action="store_true",
        help="also run the real LMCache side by side (creates its own environment on first use)",
    )
    bench.add_argument(
        "--trace",
        type=Path,
        help="the Mooncake conversation trace (default: ../shared/data/mooncake/"
        "conversation_trace.jsonl from the current directory or the checkout)",
    )
    bench.add_argument(
        "--replay-requests",
        type=int,
        help="requests of the trace the replay runs (default 2000, --quick 24; 0: all)",
    )
    bench.add_argument(
        "--peer-env",
        type=Path,
        help="the peer's virtual environment, created there if missing (default: "
        "KVTB_PEER_ENV, else ~/.cache/kvtestbed/peer-env)",
    )
    add_only_argument(bench, SECTIONS, "section")


def run_bench(args: argparse.Namespace) -> int:
    config = _config(args)
    names = [name for name in picked(SECTIONS, args.only) if SECTIONS[name].wanted(config)]
    from testbed.core.extras import require_engines

    require_engines(["replay", "vllm"])  # MissingExtra, and then bad input: before anything runs
    if {"replay", "others", "scale"} & set(names):
        find_trace(config)
    started = time.perf_counter()
    run = _run_record(config)
    with LoadWatch() as whole:
        if config.peer:
            from testbed.bench.peer.env import PeerEnvError

            try:
                run["peer_env_s"] = _peer_env(config)
            except PeerEnvError as exc:
                print(f"kvtb bench --peer: {exc}", file=sys.stderr)
                return 1
        results, sections = run_sections(config, names)
    run["wall_s"] = round(time.perf_counter() - started, 1)
    run["finished"] = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    from testbed.bench import report

    found = _versions(config)
    doc = report.document(
        [f for r in results for f in r.figures],
        [t for r in results for t in r.tables],
        run=run,
        machine=machine(),
        versions=found,
        load=whole.record,
        sections=sections,
    )
    report.write(config.out_dir, doc)
    return _print_outcome(config.out_dir / report.RESULTS, run["wall_s"], names, sections)


def _config(args: argparse.Namespace) -> BenchConfig:
    """The bench's settings from its command line; ``ValueError`` for a negative
    ``--replay-requests``."""
    if args.replay_requests is not None and args.replay_requests < 0:
        raise ValueError(f"--replay-requests must be 0 (all) or more, got {args.replay_requests}")
    return BenchConfig(
        args.out,
        quick=args.quick,
        peer=args.peer,
        trace=args.trace,
        replay_requests=args.replay_requests,
        peer_env=args.peer_env,
    )


def _run_record(config: BenchConfig) -> dict[str, Any]:
    """The report's ``run`` record as it starts: the command as typed, ``quick`` and ``peer``."""
    return {
        "command": "kvtb bench " + shlex.join(sys.argv[2:])
        if sys.argv[1:2] == ["bench"]
        else "kvtb bench",
        "quick": config.quick,
        "peer": config.peer,
    }


def _versions(config: BenchConfig) -> dict[str, str | None]:
    """The packages' versions, and with ``--peer`` the peer environment's."""
    found = versions()
    if config.peer:
        from testbed.bench.peer.env import PeerEnv, default_root, peer_versions

        found["peer environment"] = peer_versions(PeerEnv(config.peer_env or default_root()))
    return found


def _print_outcome(
    results_path: Path, wall_s: float, names: list[str], sections: dict[str, Any]
) -> int:
    """Prints how many sections ran (on stdout) and each failure (on stderr); the exit
    status: 1 if a section failed, else 0."""
    failed = [name for name, s in sections.items() if s.get("error")]
    print(
        f"kvtb bench: {len(names) - len(failed)}/{len(names)} sections in "
        f"{wall_s / 60:.1f} min → {results_path}"
    )
    for name in failed:
        print(f"  {name} failed: {sections[name]['error']}", file=sys.stderr)
    return 1 if failed else 0


def run_sections(
    config: BenchConfig, names: list[str]
) -> tuple[list[SectionResult], dict[str, Any]]:
    results, sections = [], {}
    for index, name in enumerate(names, 1):
        print(f"[{index}/{len(names)}] {name} ...", file=sys.stderr, flush=True)
        error = None
        with LoadWatch() as watch:
            try:
                result = SECTIONS[name].run(config)
            except Exception as exc:  # a section's failure is reported, not fatal
                error = f"{type(exc).__name__}: {exc}"
                traceback.print_exc(file=sys.stderr)
                result = SectionResult(
                    [missing(k, "", f"{name} failed: {error}") for k in SECTIONS[name].keys]
                )
        results.append(result)
        sections[name] = {"load": watch.record, "error": error}
        verdict = "ok" if error is None else "FAILED"
        print(
            f"[{index}/{len(names)}] {name}: {verdict} in {watch.record['wall_s']:.0f} s",
            file=sys.stderr,
            flush=True,
        )
    return results, sections


def _peer_env(config: BenchConfig) -> float:
    from testbed.bench.peer.env import default_root, ensure_peer_env

    root = config.peer_env or default_root()
    print(f"peer environment: {root} ...", file=sys.stderr, flush=True)
    _, seconds = ensure_peer_env(root, config.out_dir / "peer-env.log")
    done = f"created in {seconds:.0f} s" if seconds else "reused"
    print(f"peer environment ready ({done})", file=sys.stderr, flush=True)
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    return round(seconds, 1)
