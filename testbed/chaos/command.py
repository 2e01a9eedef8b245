"""``kvtb chaos [--quick] --out DIR``: every reliability scenario against real processes.

Runs the scenarios of :data:`SCENARIOS` one after the other (one line each on stderr as it
ends), then writes ``DIR/reliability.json`` and ``DIR/reliability.md`` (RELIABILITY.md
explains them) and exits 0 when every acceptance criterion holds, 1 otherwise. The
scenarios that need no engine run first, while a fork server imports vLLM for the others.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from testbed.chaos import (
    attacks,
    client_faults,
    crowds,
    exhaustion,
    peer_faults,
    remote_faults,
    server_faults,
    sharing,
    tier_faults,
)
from testbed.chaos.lab import ChaosConfig, Lab
from testbed.chaos.report import ScenarioResult, write_reports
from testbed.commands.only_flag import add_only_argument, picked
from testbed.core.bounds import Bound, check
from testbed.spec.paths import absolute_path

TIMEOUT_BOUND = Bound(1e-3, 3600.0, "s")
"""The range of ``--timeout`` (the engines' connector timeout; finite)."""


@dataclass(frozen=True)
class Scenario:
    run: Callable[[Lab], ScenarioResult]
    """The scenario, in its lab; the runner then finishes the lab (stops what it started,
    counts crashes, leftover files and memory into the result)."""
    engines: Callable[[ChaosConfig], bool]
    """Whether it runs replay engines (it then waits for the fork server's vLLM import)."""


def _never(config: ChaosConfig) -> bool:
    return False


def _always(config: ChaosConfig) -> bool:
    return True


def _engine_kill(config: ChaosConfig) -> bool:
    return config.engine_kill


def _full_only(config: ChaosConfig) -> bool:
    return not config.quick


SCENARIOS: dict[str, Scenario] = {
    "fuzz": Scenario(attacks.fuzz, engines=_never),
    "unauthenticated": Scenario(attacks.unauthenticated, engines=_never),
    "lost_replies": Scenario(client_faults.lost_replies, engines=_never),
    "shm_exhaustion": Scenario(exhaustion.shm_exhaustion, engines=_never),
    "connection_flood": Scenario(crowds.connection_flood, engines=_never),
    "client_kill": Scenario(client_faults.client_kill, engines=_engine_kill),
    "server_kill": Scenario(server_faults.server_kill, engines=_always),
    "server_restart": Scenario(server_faults.server_restart, engines=_always),
    "shared_server": Scenario(sharing.shared_server, engines=_always),
    "disk_full": Scenario(exhaustion.disk_full, engines=_always),
    "lock_hog": Scenario(crowds.lock_hog, engines=_full_only),
    "tier_disk_full": Scenario(tier_faults.tier_disk_full, engines=_never),
    "tier_read_error": Scenario(tier_faults.tier_read_error, engines=_never),
    "tier_slow_disk": Scenario(tier_faults.tier_slow_disk, engines=_never),
    "redis_restart": Scenario(remote_faults.redis_restart, engines=_always),
    "peer_kill": Scenario(peer_faults.peer_kill, engines=_always),
    "redis_slow_network": Scenario(remote_faults.redis_slow_network, engines=_never),
}


def add_chaos_parser(commands: Any) -> None:
    chaos = commands.add_parser(
        "chaos", help="reliability scenarios (kills, restarts, fuzzing, intruders) → a report"
    )
    chaos.add_argument("--out", type=absolute_path, required=True, help="where the report goes")
    chaos.add_argument(
        "--quick", action="store_true", help="smaller runs (well under two minutes; the tests)"
    )
    chaos.add_argument("--seed", type=int, default=0, help="fuzz and workload seed (default 0)")
    chaos.add_argument(
        "--timeout",
        type=float,
        default=2.0,
        help="the engines' connector timeout in seconds; no engine step may stall longer than "
        "it plus 1 s (default: 2)",
    )
    add_only_argument(chaos, SCENARIOS, "scenario")


def run_chaos(args: argparse.Namespace) -> int:
    problem = check(args.timeout, TIMEOUT_BOUND)
    if problem is not None:
        raise ValueError(f"--timeout {problem}, got {args.timeout}")
    config = ChaosConfig(args.out, quick=args.quick, seed=args.seed, timeout_s=args.timeout)
    names = picked(SCENARIOS, args.only)
    if any(SCENARIOS[name].engines(config) for name in names):
        from testbed.core.extras import require_engines

        require_engines(["replay"])  # before anything starts
    started = time.perf_counter()
    results = run_scenarios(config, names)
    from testbed.core.version import source_commit

    document = write_reports(
        config.out_dir,
        results,
        settings={
            "quick": config.quick,
            "seed": config.seed,
            "timeout_s": config.timeout_s,
            "wall_s": round(time.perf_counter() - started, 1),
            "cpus": os.cpu_count(),
            **source_commit(),
        },
    )
    verdict = "passed" if document["passed"] else "FAILED"
    print(
        f"kvtb chaos: {verdict} in {document['wall_s']:.0f} s → {config.out_dir / 'reliability.md'}"
    )
    for problem in document["failures"]:
        print(f"  {problem}")
    return 0 if document["passed"] else 1


def run_scenarios(config: ChaosConfig, names: list[str]) -> list[ScenarioResult]:
    """Runs ``names`` in order; a scenario that raises is reported as stopped, not fatal."""
    warm = None
    if any(SCENARIOS[name].engines(config) for name in names):
        from testbed.chaos.runs import warm_up

        warm = threading.Thread(target=warm_up, name="chaos-warm-up", daemon=True)
        warm.start()
    results = []
    for index, name in enumerate(names, 1):
        scenario = SCENARIOS[name]
        if scenario.engines(config) and warm is not None:
            warm.join()
        print(f"[{index}/{len(names)}] {name} ...", file=sys.stderr, flush=True)
        started = time.perf_counter()
        with Lab(config, name) as lab:
            try:
                result = scenario.run(lab)
                lab.finish(result)
            except Exception as exc:  # a scenario's failure is a finding, not a crash
                result = lab.result("(stopped before it finished)")
                result.error = f"{type(exc).__name__}: {exc}"
                lab.finish(result)
        result.wall_s = time.perf_counter() - started
        verdict = "ok" if result.passed else "FAILED"
        if result.skipped:
            verdict = f"skipped ({result.skipped})"
        print(
            f"[{index}/{len(names)}] {name}: {verdict} in {result.wall_s:.1f} s",
            file=sys.stderr,
            flush=True,
        )
        results.append(result)
    return results
