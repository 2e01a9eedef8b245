"""Engine runs in child processes, for scenarios that kill things around them.

Runs in the chaos process. A :class:`RunChild` is one ``testbed.run.execute_run`` of the
replay engine in a child of a fork server that imported vLLM once (:func:`fork_context`), so
a run starts in about a second instead of paying vLLM's import each time; several run at
once. The child counts finished requests in shared memory (:attr:`RunChild.done`), writes
its log (and a traceback if it fails) to ``<out>/child.log``, and leaves its run directory
as any run does: ``summary.json`` and ``metrics.parquet``. The chaos process may SIGKILL the
child, or the cache server the child's run started (:meth:`RunChild.server_pids`). The child
gets SIGTERM when its fork server exits, which it does with the chaos process, so a chaos
process killed by SIGKILL leaves no run going.

Pace: each step of a chaos run lasts at least :attr:`EngineRun.step_s` (20 ms by default), as
a forward pass would, so that a run lasts long enough for a kill, a restart and a recovery to
happen inside it (without it the replay engine serves a short workload in a fraction of a
second). It is set in the child before the run starts; the engine, connector and server code
run unchanged.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.context import ForkServerContext
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path
from typing import Any

from testbed.core.credentials import ServerEndpoint
from testbed.core.run_dir import RunDir
from testbed.spec.runspec import RunSpec

_PRELOAD = ["testbed.chaos.runs", "testbed.run", "testbed.engine.replay"]
_context: ForkServerContext | None = None


def fork_context() -> ForkServerContext:
    """The fork server of run children (vLLM imported once, in it)."""
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(_PRELOAD)
    return _context


def warm_up() -> None:
    """Starts the fork server and waits until it has imported vLLM (call on a thread to
    overlap that import with other work)."""
    child = fork_context().Process(target=_noop, name="kvtb-chaos-warm-up")
    child.start()
    child.join()


def _noop() -> None:
    pass


@dataclass(frozen=True)
class EngineRun:
    spec: RunSpec
    out_dir: Path
    endpoint: ServerEndpoint | None
    """An external server, or ``None``: the run starts its own."""
    step_s: float = 0.0
    """Wall time each engine step takes at least, as a forward pass would (the replay engine
    without it runs a short workload in a fraction of a second, faster than any failure is
    noticed or recovered from)."""

    @property
    def run_dir(self) -> Path:
        return self.out_dir / self.spec.run_id


class RunChild:
    """One engine run in a child process. Not reusable."""

    def __init__(self, run: EngineRun) -> None:
        self.run = run
        self.log_path = run.out_dir / "child.log"
        context = fork_context()
        self._done: Synchronized[int] = context.Value("i", 0, lock=False)  # one writer
        self._process = context.Process(
            target=_child_main,
            args=(run, self._done, self.log_path),
            name=f"kvtb-chaos-{run.spec.workload}",
        )
        self.started_at = 0.0
        self.ended_at: float | None = None

    def start(self) -> RunChild:
        self.run.out_dir.mkdir(parents=True, exist_ok=True)
        self._process.start()
        self.started_at = time.monotonic()
        return self

    @property
    def pid(self) -> int:
        assert self._process.pid is not None
        return self._process.pid

    @property
    def done(self) -> int:
        """Requests finished so far."""
        return int(self._done.value)

    @property
    def running(self) -> bool:
        return self._process.exitcode is None

    def wait(self, timeout_s: float) -> int | None:
        """The child's exit code, or ``None`` if it still runs after ``timeout_s``."""
        self._process.join(timeout_s)
        if self._process.exitcode is not None and self.ended_at is None:
            self.ended_at = time.monotonic()
        return self._process.exitcode

    def wait_for(self, done: int, timeout_s: float) -> bool:
        """Waits until ``done`` requests finished (True) or the child ended or timed out."""
        deadline = time.monotonic() + timeout_s
        while self.done < done:
            if not self.running or time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def kill(self) -> None:
        """SIGKILL, as a crash of the engine process would."""
        if self.running:
            os.kill(self.pid, signal.SIGKILL)
            self.wait(10.0)

    def server_pids(self) -> list[int]:
        """Cache servers the child's run started (its own server)."""
        return [pid for pid in _children(self.pid) if b"-m\x00server" in _cmdline(pid)]

    def summary(self) -> dict[str, Any] | None:
        path = RunDir(self.run.run_dir).summary
        if not path.is_file():
            return None
        summary: dict[str, Any] = json.loads(path.read_text())
        return summary

    def failure(self) -> str | None:
        """The last lines of the child's log when it exited with an error."""
        if self._process.exitcode in (None, 0):
            return None
        tail = self.log_path.read_text()[-2000:] if self.log_path.is_file() else ""
        return f"exit code {self._process.exitcode}: {tail.strip()}"


def _child_main(run: EngineRun, done: Synchronized[int], log_path: Path) -> None:
    logging.basicConfig(
        filename=log_path, level=logging.WARNING, format="%(asctime)s %(name)s %(message)s"
    )
    try:
        from testbed.core.process_groups import terminate_with_parent
        from testbed.run import RunOptions, execute_run

        terminate_with_parent()  # its parent, the fork server, exits with the chaos process
        pace_steps(run.step_s)

        def progress(finished: int, total: int) -> None:
            done.value = finished

        execute_run(
            run.spec,
            run.out_dir,
            RunOptions(server=run.endpoint, progress=False, on_progress=progress),
        )
    except BaseException:
        with open(log_path, "a") as log:
            traceback.print_exc(file=log)
        sys.stderr.flush()
        os._exit(1)


def pace_steps(step_s: float) -> None:
    """Makes every replay step in this process last at least ``step_s`` (a forward pass)."""
    if step_s <= 0:
        return
    from testbed.engine import worker_harness

    execute = worker_harness.WorkerHarness.execute

    def paced(self: worker_harness.WorkerHarness, scheduler_output: Any) -> Any:
        time.sleep(step_s)
        return execute(self, scheduler_output)

    worker_harness.WorkerHarness.execute = paced  # type: ignore[method-assign]


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(entry))
    return found


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read()
    except OSError:
        return b""
