"""What-if curves against the oracle runs they replace, on the Mooncake conversation trace.

One what-if gives the exact LRU curve at every capacity for each chunk size; the baseline is
what answering the same question costs without it: one oracle run (``simulate(requests, C,
"lru", capacity)``, hashing the prompts as ``kvtb run --engine oracle`` does) per chunk size
and capacity, 4 x 8 = 32 runs with the defaults. Both are measured in this run, on the same
requests; the oracle's requests are synthesised once beforehand and not charged to it. A
second baseline hashes once per chunk size and simulates the 8 capacities on the keys (the
oracle at its cheapest). The what-if runs in a fresh process so that its peak memory (RSS) is
its own; its time is the median of ``--rounds`` (the numba kernel compiled beforehand). Every
oracle point is checked against the curve. ``--sample-rate`` adds a SHARDS row: its time and
its largest difference from the exact curve over a 48-point capacity grid.

    python -m testbed.bench.whatif [--requests N] [--chunk-sizes 64,128,256,512] [--rounds 3]

The full trace (12,031 requests, 145M prompt tokens) takes several minutes, nearly all of it
in the oracle runs.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from testbed.bench.config import TRACE_IN_CHECKOUT
from testbed.bench.tables import table

CAPACITIES = tuple(1 << k for k in range(18, 26))  # 256Ki .. 32Mi tokens


def whatif_child(spec_values: dict[str, Any], sizes: list[int], rounds: int, rate: float) -> dict:
    """In a fresh process: ``rounds`` what-ifs (keys, stack, curve per chunk size)."""
    from testbed.analysis.whatif import lru_curve, stack_distances
    from testbed.analysis.whatif.curves import capacity_grid, max_abs_difference
    from testbed.analysis.whatif.sources import workload_traces
    from testbed.spec.runspec import RunSpec

    spec = RunSpec(**spec_values)
    warm = workload_traces(RunSpec(**{**spec_values, "requests": 20}), sizes[:1])
    stack_distances(next(iter(warm.values())))  # compile (or load) the kernel
    samples: list[float] = []
    for _ in range(rounds):
        started = time.perf_counter()
        traces = workload_traces(spec, sizes)
        curves = {size: lru_curve(trace, stack_distances(trace)) for size, trace in traces.items()}
        samples.append(time.perf_counter() - started)
    result: dict[str, Any] = {
        "samples_s": samples,
        "points": {
            size: [curve.at(c).hit_tokens for c in (*CAPACITIES, None)]
            for size, curve in curves.items()
        },
        "chunks": {size: len(trace.query_keys) for size, trace in traces.items()},
        "distinct": {size: curve.num_distinct_keys for size, curve in curves.items()},
        "prompt_tokens": next(iter(curves.values())).prompt_tokens,
        "requests": next(iter(curves.values())).num_requests,
    }
    if rate < 1.0:
        started = time.perf_counter()
        sampled = {size: lru_curve(t, stack_distances(t, rate)) for size, t in traces.items()}
        result["sampled_s"] = time.perf_counter() - started
        result["sampled_error"] = {
            size: max_abs_difference(curves[size], sampled[size], capacity_grid(curves[size], 48))
            for size in sizes
        }
    result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=None, help="first N (default: all)")
    parser.add_argument("--chunk-sizes", default="64,128,256,512")
    parser.add_argument("--rounds", type=int, default=3, help="what-if rounds (median)")
    parser.add_argument("--sample-rate", type=float, default=0.01)
    parser.add_argument(
        "--trace", type=Path, default=TRACE_IN_CHECKOUT, help="the Mooncake conversation trace"
    )
    args = parser.parse_args()
    sizes = [int(s) for s in args.chunk_sizes.split(",")]
    spec_values = {"workload": f"mooncake:{args.trace}", "requests": args.requests}

    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        whatif = pool.submit(whatif_child, spec_values, sizes, args.rounds, args.sample_rate)
        child = whatif.result()
    baseline = oracle_baseline(spec_values, sizes, child)
    print_comparison(child, baseline, sizes, args.sample_rate)


@dataclass(frozen=True)
class OracleBaseline:
    """The oracle runs a what-if replaces, timed: one per chunk size and capacity, hashing the
    prompts each time, and per chunk size, hashing once and simulating every capacity."""

    synthesis_s: float
    """Synthesising the requests (once, not charged to the oracle)."""
    runs_s: dict[int, list[float]]
    """Per chunk size, each capacity's run."""
    keyed_s: dict[int, float]
    """Per chunk size: hashing once and simulating every capacity."""
    mismatches: int
    """Oracle points that differ from the curve's."""

    @property
    def num_runs(self) -> int:
        return sum(len(samples) for samples in self.runs_s.values())


def oracle_baseline(spec_values: dict[str, Any], sizes: list[int], child: dict) -> OracleBaseline:
    """The oracle's answers to the what-if's questions, timed and checked against the curve."""
    from testbed.analysis.whatif.sources import servable_requests
    from testbed.models.access_trace import hashed_trace
    from testbed.models.oracle import simulate, simulate_keys
    from testbed.spec.runspec import RunSpec

    started = time.perf_counter()
    requests = servable_requests(RunSpec(**spec_values))
    synthesis_s = time.perf_counter() - started
    runs_s: dict[int, list[float]] = {}
    keyed_s: dict[int, float] = {}
    mismatches = 0
    for size in sizes:
        runs_s[size] = []
        for index, capacity in enumerate(CAPACITIES):
            started = time.perf_counter()
            result = simulate(requests, size, "lru", capacity // size)
            runs_s[size].append(time.perf_counter() - started)
            mismatches += result.hit_tokens != child["points"][size][index]
        started = time.perf_counter()
        keys = hashed_trace(requests, size)
        for capacity in CAPACITIES:
            simulate_keys(keys, "lru", capacity // size)
        keyed_s[size] = time.perf_counter() - started
        mismatches += simulate_keys(keys).hit_tokens != child["points"][size][-1]
    return OracleBaseline(synthesis_s, runs_s, keyed_s, mismatches)


def print_comparison(child: dict, baseline: OracleBaseline, sizes: list[int], rate: float) -> None:
    """The what-if against the oracle: in total, then per chunk size."""
    print(
        f"{child['requests']} requests, {child['prompt_tokens'] / 1e6:.1f}M prompt tokens; "
        f"chunk sizes {sizes}; capacities {CAPACITIES[0]:,}..{CAPACITIES[-1]:,} tokens "
        f"({len(CAPACITIES)}); oracle requests synthesised once in {baseline.synthesis_s:.1f} s"
    )
    _print_totals(child, baseline, sizes, rate)
    print()
    _print_per_size(child, baseline, sizes)
    print(f"what-if rounds (s): {', '.join(f'{s:.2f}' for s in child['samples_s'])}")
    print(
        f"oracle points that differ from the curve: {baseline.mismatches} of "
        f"{baseline.num_runs + len(sizes)}"
    )


def _print_totals(child: dict, baseline: OracleBaseline, sizes: list[int], rate: float) -> None:
    """The what-if's median time and peak memory beside both oracles' total times (and the
    sampled what-if's, when it ran), then the time ratios."""
    runs_s, keyed_s = baseline.runs_s, baseline.keyed_s
    whatif_s = statistics.median(child["samples_s"])
    oracle_s = sum(s for samples in runs_s.values() for s in samples)
    keyed_total_s, num_runs = sum(keyed_s.values()), baseline.num_runs
    rss = f"{child['peak_rss_bytes'] / 2**30:.2f}"
    rows = [
        (f"what-if: {len(sizes)} exact LRU curves, every capacity", f"{whatif_s:.2f}", "1", rss),
        (f"oracle: {num_runs} runs, each hashing its prompts", f"{oracle_s:.1f}",
         f"{oracle_s / whatif_s:.0f}", ""),
        (f"oracle: hashed once per chunk size, {num_runs} simulations",
         f"{keyed_total_s:.1f}", f"{keyed_total_s / whatif_s:.0f}", ""),
    ]  # fmt: skip
    if "sampled_s" in child:
        worst = max(child["sampled_error"].values())
        rows.append(
            (
                f"what-if sampled at {rate:g} (max error {worst:.4f})",
                f"{child['sampled_s']:.2f}",
                f"{child['sampled_s'] / whatif_s:.2f}",
                "",
            )
        )
    print(table(rows, ("", "wall s", "time / what-if", "peak RSS GiB")))
    print(
        f"what-if time / {num_runs} oracle runs: {whatif_s / oracle_s:.4f} "
        f"(/ keyed oracle: {whatif_s / keyed_total_s:.4f})"
    )


def _print_per_size(child: dict, baseline: OracleBaseline, sizes: list[int]) -> None:
    """Per chunk size: its lookups, distinct chunks, both oracles' times and the sampled
    what-if's largest error (blank when it did not run)."""
    per_size = [
        (
            str(size),
            f"{child['chunks'][size]:,}",
            f"{child['distinct'][size]:,}",
            f"{statistics.median(baseline.runs_s[size]):.2f}",
            f"{baseline.keyed_s[size]:.2f}",
            f"{child['sampled_error'][size]:.4f}" if "sampled_error" in child else "",
        )
        for size in sizes
    ]
    print(
        table(
            per_size,
            (
                "chunk",
                "chunk lookups",
                "distinct chunks",
                "oracle run s (median)",
                "hash once + 8 sims s",
                "sampled max error",
            ),
        )  # fmt: skip
    )


if __name__ == "__main__":
    main()
