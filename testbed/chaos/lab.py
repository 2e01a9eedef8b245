"""What every chaos scenario needs: its settings, its directory, the processes it starts.

Runs in the chaos process. :class:`ChaosConfig` holds the sizes of a quick and a full run;
a :class:`Lab` is one scenario's workspace: it starts cache servers (each logging to the
scenario's directory) and engine runs, remembers which servers it killed on purpose, counts
the others that died (``server_crashes``), stops everything on close, and finds the files
its dead servers left behind (``leaked_shm_files``).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from server.launch import ServerProcess
from testbed.chaos.report import ScenarioResult
from testbed.chaos.runs import EngineRun, RunChild
from testbed.chaos.watch import leftover_files, rss_mib
from testbed.commands.quick_sizes import QuickOrFull
from testbed.core.closing import Closing
from testbed.core.credentials import ServerEndpoint
from testbed.spec.runspec import RunSpec

CHUNK_SIZE = 64
BLOCK_SIZE = 16
ENGINE_BLOCKS = 384
"""vLLM's own KV pool in chaos runs: 6,144 tokens, a few requests' worth (the longest
request fits), so that vLLM's prefix cache forgets and the external cache serves: retrieves
happen, and can fail."""
WORKLOAD_PARAMS: dict[str, dict[str, Any]] = {
    "docqa": {"document_tokens": [1024, 2048], "questions_per_document": 3},
}
"""Smaller documents than the generators' defaults, so that runs take seconds."""


@dataclass(frozen=True)
class ChaosConfig:
    out_dir: Path
    quick: bool = False
    seed: int = 0
    timeout_s: float = 2.0
    """The connector timeout of every engine run (and the bound on a step's stall, + 1 s)."""
    step_s: float = 0.02
    """The least wall time of an engine step (a forward pass; see ``testbed.chaos.runs``)."""

    fuzz_frames = QuickOrFull(10_000, 30_000)
    run_requests = QuickOrFull(12, 48)
    """Requests of each run that a server kill interrupts."""
    shared_requests = QuickOrFull(8, 24)
    """Requests of each of the four engines that share one server."""
    engine_kill = QuickOrFull(False, True)
    """Whether to also SIGKILL a whole engine (its server reaps it after a client timeout
    above the connector's 10 s heartbeat: slow, so the full run only)."""


class Lab(Closing):
    """One scenario's processes; ``close()`` stops them all. Context manager."""

    def __init__(self, config: ChaosConfig, name: str) -> None:
        self.config = config
        self.name = name
        """The scenario's name (its key in ``testbed.chaos.command.SCENARIOS``)."""
        self.dir = config.out_dir / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.servers: list[ServerProcess] = []
        self.runs: list[RunChild] = []
        self.server_pids: set[int] = set()
        self.killed: set[int] = set()
        self.stopped: set[int] = set()
        self.max_rss_mib = 0.0
        self._crashes: int | None = None

    def result(self, proves: str) -> ScenarioResult:
        """The scenario's result, under its name, saying what the scenario ``proves``."""
        return ScenarioResult(self.name, proves)

    # --- processes -----------------------------------------------------------------------------

    def server(self, *args: str, wrapper: Sequence[str] = ()) -> ServerProcess:
        """Starts a server with ``args`` (under ``wrapper``: ``prlimit``, private mounts)."""
        log = self.dir / f"server-{len(self.servers)}.log"
        server = ServerProcess(list(args), log_path=log, wrapper=wrapper).start()
        self.servers.append(server)
        self.server_pids.add(server.pid)
        return server

    def kill(self, pid: int) -> None:
        """SIGKILLs a server (ours, or one a run started: :meth:`RunChild.server_pids`)."""
        self.sample_rss(pid)
        self.killed.add(pid)
        self.server_pids.add(pid)
        for server in self.servers:
            if server.pid == pid:
                server.kill()
                return
        os.kill(pid, signal.SIGKILL)
        _wait_gone(pid)

    def stop(self, server: ServerProcess) -> None:
        """Stops a server cleanly (SIGTERM) before the scenario ends."""
        self.sample_rss(server.pid)
        self.stopped.add(server.pid)
        server.close()

    def sample_rss(self, pid: int) -> None:
        rss = rss_mib(pid)
        if rss is not None:
            self.max_rss_mib = max(self.max_rss_mib, rss)

    def spec(self, workload: str, requests: int, seed: int = 0) -> RunSpec:
        return RunSpec(
            engine="replay",
            workload=workload,
            requests=requests,
            seed=self.config.seed + seed,
            chunk_size=CHUNK_SIZE,
            block_size=BLOCK_SIZE,
            max_output_tokens=2,
            engine_blocks=ENGINE_BLOCKS,
            server_timeout_s=self.config.timeout_s,
            workload_params=WORKLOAD_PARAMS.get(workload, {}),
        )

    def run(self, spec: RunSpec, server: ServerProcess | None, name: str) -> RunChild:
        endpoint = None if server is None else ServerEndpoint(server.url, server.token)
        run = EngineRun(spec, self.dir / name, endpoint, self.config.step_s)
        child = RunChild(run)
        self.runs.append(child)
        return child.start()

    # --- accounting ----------------------------------------------------------------------------

    def crashes(self) -> int:
        """Servers this scenario started that died without being killed on purpose."""
        if self._crashes is None:
            return sum(
                1
                for server in self.servers
                if server.pid not in self.killed | self.stopped
                and server.process is not None
                and server.process.poll() is not None
            )
        return self._crashes

    def close(self) -> None:
        if self._crashes is not None:
            return
        self._crashes = self.crashes()
        for server in self.servers:
            if server.process is not None and server.process.poll() is None:
                self.sample_rss(server.pid)
            server.close()
        for child in self.runs:
            child.kill()

    def leftover_files(self) -> list[Path]:
        """Pool and token files of this scenario's servers that are gone."""
        return leftover_files(self.server_pids)

    def record_run(self, result: ScenarioResult, child: RunChild) -> dict[str, Any] | None:
        """Adds a finished run's requests, integrity errors and stalls to ``result``."""
        summary = child.summary()
        requests = child.run.spec.requests or 0
        result.add(requests_total=requests)
        if summary is None:
            result.add(requests_completed=0)
            result.details.setdefault("run_failures", []).append(child.failure() or "no summary")
            return None
        if summary.get("requests_rejected"):
            result.details.setdefault("rejected", []).append(summary["requests_rejected"])
        result.add(
            requests_completed=int(summary.get("requests") or 0),
            integrity_errors=int(summary.get("integrity_errors") or 0),
        )
        result.maximum(max_step_stall_s=summary.get("max_step_stall_s"))
        return summary

    def finish(self, result: ScenarioResult) -> None:
        """Closes everything and records crashes, RSS and leftover files."""
        self.close()
        leftovers = self.leftover_files()
        result.add(server_crashes=self.crashes(), leaked_shm_files=len(leftovers))
        result.maximum(max_server_rss_mib=self.max_rss_mib or None)
        if leftovers:
            result.details["leftover_files"] = [str(path) for path in leftovers]


def _wait_gone(pid: int, timeout_s: float = 10.0) -> None:
    """Waits until ``pid`` has exited (a zombie has: its parent reaps it later)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except OSError:
            return
        time.sleep(0.02)
