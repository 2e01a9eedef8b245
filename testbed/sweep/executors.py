"""Executing a sweep's runs: each run in its own process, on this machine or as Ray tasks.

Every run executes in a child process (:class:`RunProcess`) that leads its own process
group, so the run and the cache server it starts can be stopped together: SIGTERM to the
group (the run unwinds and closes its server), then SIGKILL to whatever is left. The child
also gets SIGTERM if its parent dies (Linux ``PR_SET_PDEATHSIG``), so killing a sweep leaves
no run or server behind. Children fork from a fork server that imported the run's code once
(:func:`fork_context`): no run pays vLLM's import. A run that raises, or a child that dies, is
a failed :class:`RunOutcome`; it never stops the other runs.

- :func:`run_local`: at most ``jobs`` children at once, multiplexed in the calling thread.
- :func:`run_ray`: one Ray task per run (``ray.remote``), each running a :class:`RunProcess`
  on its node. A local Ray instance is started when no address is given. Runs write to the
  same ``out_dir`` path on every node, so on a cluster it must be shared storage, and
  ``kvtestbed`` must be importable on every node.

Both are generators: closing one (``contextlib.closing``), or an exception raised while it
waits (KeyboardInterrupt), stops every run still going. The fork server starts fresh (it is
not forked from the caller: no ZeroMQ or thread state of the caller is inherited), so a script
calling them needs the usual ``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.context import ForkServerContext
from pathlib import Path
from typing import Any

from testbed.core.process_groups import stop_groups, terminate_with_parent, watch_groups
from testbed.run import RunOptions, execute_run
from testbed.spec.runspec import RunSpec
from testbed.sweep.index import record_failure

ProgressCallback = Callable[[RunSpec, int, int], None]
"""Called with (run, requests done, requests total) while a run is going (local executor)."""

_STOP_GRACE_S = 10.0
_PROGRESS_INTERVAL_S = 0.2
_REPO_ROOT = Path(__file__).resolve().parents[2]
_PRELOAD = ["testbed.run", "testbed.run.summary", "testbed.engine.replay"]


@dataclass(frozen=True)
class RunOutcome:
    """How one run ended; ``error`` (one line) is ``None`` when it completed."""

    run_id: str
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class RunProcess:
    """One run in a child process (forked by :func:`fork_context`'s server) that leads its own
    process group."""

    def __init__(self, spec: RunSpec, out_dir: Path) -> None:
        self.spec = spec
        self.out_dir = Path(out_dir)
        context = fork_context()
        self._conn, child_conn = context.Pipe(duplex=False)
        self.process = context.Process(
            target=_child_main,
            args=(spec, self.out_dir, child_conn),
            name=f"kvtb-run-{spec.run_id}",
        )
        self.process.start()
        child_conn.close()
        self._result: tuple[str | None, str] | None = None
        self._groups: list[int] = []
        """The process groups the run started (its cache servers, vLLM's servers): stopped
        with it if it cannot stop them itself."""

    @property
    def waitables(self) -> list[Any]:
        """What :func:`multiprocessing.connection.wait` should watch for this run."""
        return [self._conn, self.process.sentinel]

    def poll(self, on_progress: ProgressCallback | None = None) -> RunOutcome | None:
        """Handles the child's messages; once it has ended, its outcome (failures go to disk)."""
        exited = self.process.exitcode is not None  # before draining: its last words are read too
        self._read(on_progress)
        if self._result is None and not exited:
            return None
        if self._result is None:
            # Died without a word (killed, out of memory): its server may still be running.
            self.stop()
            self._result = (f"run process exited with code {self.process.exitcode}", "")
        self.process.join(_STOP_GRACE_S)
        if self.process.exitcode is None:  # reported, but something keeps it from exiting
            self.stop(grace_s=0.0)
        error, details = self._result
        if error is not None:
            record_failure(self.out_dir / self.spec.run_id, self.spec, error, details)
        return RunOutcome(self.spec.run_id, error)

    def _read(self, on_progress: ProgressCallback | None = None) -> None:
        """Handles the child's messages waiting in the pipe, up to its last (``done``)."""
        with contextlib.suppress(EOFError, OSError):
            while self._result is None and self._conn.poll():
                message = self._conn.recv()
                if message[0] == "progress" and on_progress is not None:
                    on_progress(self.spec, message[1], message[2])
                elif message[0] == "group":
                    self._groups.append(message[1])
                elif message[0] == "done":
                    self._result = (message[1], message[2])

    def wait(self, on_progress: ProgressCallback | None = None) -> RunOutcome:
        """Blocks until the run ends; any exception here (KeyboardInterrupt) stops it first."""
        try:
            while (outcome := self.poll(on_progress)) is None:
                wait(self.waitables)
            return outcome
        except BaseException:
            self.stop()
            raise

    def stop(self, grace_s: float = _STOP_GRACE_S) -> None:
        """Stops the run and all it started: SIGTERM to its group, SIGKILL after ``grace_s``."""
        if self.process.exitcode is None:
            self.terminate()
            self.process.join(grace_s)
        self._signal_group(signal.SIGKILL)  # stragglers, e.g. a server whose run was killed
        self.process.join()
        self._wait_group_gone()
        self._read()  # the groups it named, to the last
        # A server the run started leads a group of its own, out of the run's; the run's
        # shutdown stops it, unless the run was killed first (the grace ran out).
        stop_groups(self._groups)
        self._conn.close()

    def terminate(self) -> None:
        """Asks the run to stop (SIGTERM to its group) without waiting; :meth:`stop` finishes it."""
        if self.process.exitcode is None:
            self._signal_group(signal.SIGTERM)

    def _wait_group_gone(self, timeout_s: float = 5.0) -> None:
        # SIGKILL is delivered at once but a process takes a moment to die; callers (and a
        # sweep about to exit) rely on nothing of the run being left when stop() returns.
        # Bounded: an unreaped zombie still counts as a member of its group.
        pid = self.process.pid
        deadline = time.monotonic() + timeout_s
        while pid is not None and time.monotonic() < deadline:
            try:
                os.killpg(pid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.02)

    def _signal_group(self, signum: int) -> None:
        pid = self.process.pid
        if pid is None:
            return
        try:
            os.killpg(pid, signum)
        except ProcessLookupError:
            # No group (yet): the child has not called setpgid, so it has started nothing.
            if self.process.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)


def fork_context() -> ForkServerContext:
    """Run processes fork from a server that imported the run's code once (vLLM and torch
    with the replay engine, when installed): a run starts in about a second instead of paying
    that import each time. Importing starts no ZeroMQ context, so none is forked."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    return context


def _child_main(spec: RunSpec, out_dir: Path, conn: Connection) -> None:
    """Entry point of a run's child process: run, then report ``("done", error, traceback)``."""
    os.setpgid(0, 0)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    terminate_with_parent()  # its parent, the fork server, exits with the sweep
    sending = threading.Lock()  # servers may start from other threads (a fleet's)

    def send(*message: object) -> None:
        with sending, contextlib.suppress(OSError):
            conn.send(message)

    watch_groups(lambda group: send("group", group))
    last_sent = 0.0

    def progress(done: int, total: int) -> None:
        nonlocal last_sent
        now = time.monotonic()
        if done == total or now - last_sent >= _PROGRESS_INTERVAL_S:
            last_sent = now
            send("progress", done, total)

    try:
        summary = execute_run(spec, out_dir, RunOptions(progress=False, on_progress=progress))
    except BaseException as exc:  # SystemExit from SIGTERM too: the parent is waiting for a word
        send("done", f"{type(exc).__name__}: {exc}", traceback.format_exc())
        if not isinstance(exc, Exception):
            raise
        return
    failed = summary.get("failures")
    send("done", f"the run failed: {'; '.join(failed)}" if failed else None, "")


def _exit_on_sigterm(signum: int, frame: object) -> None:
    # Unwind instead of dying on the spot, so execute_run's finally blocks close its server.
    raise SystemExit(128 + signum)


def run_local(
    specs: Sequence[RunSpec],
    out_dir: Path,
    *,
    jobs: int = 1,
    on_progress: ProgressCallback | None = None,
) -> Generator[RunOutcome, None, None]:
    """Runs ``specs`` in at most ``jobs`` child processes; yields outcomes as runs end."""
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    pending = list(reversed(specs))
    running: list[RunProcess] = []
    try:
        while pending or running:
            while pending and len(running) < jobs:
                running.append(RunProcess(pending.pop(), out_dir))
            wait([item for run in running for item in run.waitables])
            for run in list(running):
                outcome = run.poll(on_progress)
                if outcome is not None:
                    running.remove(run)
                    yield outcome
    finally:
        for run in running:
            run.terminate()  # all at once: their grace periods overlap
        for run in running:
            run.stop()


class RayMissing(RuntimeError):
    """The Ray executor was asked for where Ray is not installed."""


def require_ray() -> Any:
    """The ``ray`` module, imported on first use (Ray is an optional dependency)."""
    try:
        import ray
    except ImportError:
        raise RayMissing("the Ray executor needs Ray: pip install 'kvtestbed[ray]'") from None
    return ray


def run_ray(
    specs: Sequence[RunSpec],
    out_dir: Path,
    *,
    jobs: int | None = None,
    address: str | None = None,
) -> Generator[RunOutcome, None, None]:
    """Runs each spec as a Ray task; yields outcomes as runs end.

    Without ``address`` a local Ray instance with ``jobs`` CPUs (default: all) is started and
    shut down afterwards; with one, the cluster's free CPUs bound the runs in flight (one CPU
    each). Closing the generator cancels every task still going, which stops its run.
    """
    ray = require_ray()
    out_dir = Path(out_dir).resolve()  # Ray workers have their own working directory
    started_here = not ray.is_initialized()  # then shut down after, a failed start too
    try:
        if started_here and address is None:
            ray.init(
                num_cpus=jobs or os.cpu_count(),
                include_dashboard=False,
                log_to_driver=False,
                # Workers of a local instance import testbed from this checkout.
                runtime_env={"env_vars": {"PYTHONPATH": _python_path()}},
            )
        elif started_here:
            ray.init(address=address, log_to_driver=False)
        task = ray.remote(num_cpus=1, max_retries=0)(_ray_task)
        refs = {task.remote(spec, str(out_dir)): spec for spec in specs}
        yield from _ray_outcomes(ray, refs, out_dir)
    finally:
        if started_here:
            ray.shutdown()


def _ray_outcomes(ray: Any, refs: dict[Any, RunSpec], out_dir: Path) -> Iterator[RunOutcome]:
    """The tasks' outcomes as they end; closing it cancels the tasks still going."""
    try:
        while refs:
            ready, _ = ray.wait(list(refs), num_returns=1)
            spec = refs.pop(ready[0])
            try:
                outcome = ray.get(ready[0])
            except Exception as exc:  # the task itself failed (worker lost, ...)
                error = f"Ray task failed: {type(exc).__name__}: {exc}".splitlines()[0]
                record_failure(Path(out_dir) / spec.run_id, spec, error, str(exc))
                outcome = RunOutcome(spec.run_id, error)
            yield outcome
    finally:
        for ref in refs:
            # KeyboardInterrupt inside the task: RunProcess.wait stops its run group.
            ray.cancel(ref, force=False)
        if refs:
            ray.wait(list(refs), num_returns=len(refs), timeout=_STOP_GRACE_S + 5)


def _python_path() -> str:
    return os.pathsep.join(filter(None, [str(_REPO_ROOT), os.environ.get("PYTHONPATH")]))


def _ray_task(spec: RunSpec, out_dir: str) -> RunOutcome:
    """A Ray task: one run in a child process of this Ray worker."""
    return RunProcess(spec, Path(out_dir)).wait()
