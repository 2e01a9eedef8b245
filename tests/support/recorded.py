"""Running an engine the way a run does, so that tests read results from the telemetry.

:func:`recorded_run` starts a cache server writing its spans and chunk log into a run
directory, installs the engine process's tracing into the same directory, runs the engine,
then stops both and reads the accounting back with ``testbed.analysis.attribution``: tests
check what the record says, as every report does, never the engine's private counters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from server.launch import ServerProcess
from testbed.analysis.attribution import attribution
from testbed.analysis.tables import Run
from testbed.core import protocol as p
from testbed.core.credentials import ServerEndpoint
from testbed.core.rpc import RpcClient
from testbed.core.telemetry.setup import TracingConfig, configure_tracing
from testbed.engine.results import EngineResult


@dataclass
class Recorded:
    run_dir: Path
    result: EngineResult
    stats: p.ServerStats
    """The server's statistics after the engine closed."""
    requests: pd.DataFrame
    """The attribution table, indexed by the workload's request id."""

    @property
    def run(self) -> Run:
        return Run(self.run_dir)

    def __getitem__(self, request_id: str) -> pd.Series:
        return self.requests.loc[request_id]


def recorded_run(
    run_dir: Path,
    server_args: list[str],
    engine: Callable[[ServerEndpoint], EngineResult],
) -> Recorded:
    """Runs ``engine(endpoint)`` against a fresh server; everything recorded in ``run_dir``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    server = ServerProcess(
        [*server_args, "--run-dir", str(run_dir)], log_path=run_dir / "server.log"
    ).start()
    try:
        endpoint = ServerEndpoint(server.url, server.token, server.admin_token)
        result, stats = _traced(run_dir, endpoint, engine)
    finally:
        server.close()
    return Recorded(run_dir, result, stats, _table(run_dir))


def recorded_engine(
    run_dir: Path, endpoint: ServerEndpoint, engine: Callable[[ServerEndpoint], EngineResult]
) -> Recorded:
    """Runs ``engine(endpoint)`` against a server that keeps its own telemetry elsewhere; the
    engine's (and its connector's) spans are recorded in ``run_dir``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    result, stats = _traced(run_dir, endpoint, engine)
    return Recorded(run_dir, result, stats, _table(run_dir))


def _traced(
    run_dir: Path, endpoint: ServerEndpoint, engine: Callable[[ServerEndpoint], EngineResult]
) -> tuple[EngineResult, p.ServerStats]:
    tracing = configure_tracing(TracingConfig("kvtb-engine", run_dir=run_dir))
    try:
        result = engine(endpoint)
    finally:
        if tracing is not None:
            tracing.shutdown()
    with RpcClient(endpoint.url, token=endpoint.token) as client:
        stats = client.call(p.GetStats())
    assert isinstance(stats, p.ServerStats)
    return result, stats


def _table(run_dir: Path) -> pd.DataFrame:
    table = attribution(run_dir)
    key = "workload_request_id" if table["workload_request_id"].notna().all() else "request_id"
    return table.set_index(key, drop=False)
