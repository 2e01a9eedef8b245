"""Running a sweep: ``kvtb sweep`` and ``kvtb demo``, and :func:`run_sweep` behind both.

:func:`run_sweep` writes ``OUT/<name>/sweep.toml`` and ``sweep.json``, skips every run that is
already complete (a finished run of exactly its spec: ``testbed.run.is_reusable``; one made
from another spec is redone, with a log line saying which fields differ), executes the
others (local processes or Ray tasks, see :mod:`testbed.sweep.executors`), then builds
``index.parquet``. Running it again does nothing new; after a crash or Ctrl-C it finishes only
the runs that are missing (a half-written run is redone by ``execute_run``). Failed runs (an
error, or a summary that lists failures: ``testbed.run.failure``) are recorded and retried by
the next invocation, never reused; they never stop the sweep.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from testbed.core.extras import require_engines, require_redis
from testbed.core.process_groups import sigterm_as_interrupt
from testbed.run import is_reusable, reuse_differences
from testbed.spec.flags import assignments
from testbed.spec.inputs import data_dir
from testbed.spec.runspec import RunSpec
from testbed.sweep.executors import RayMissing, RunOutcome, require_ray, run_local, run_ray
from testbed.sweep.experiments import resolve_sweep_file
from testbed.sweep.index import INDEX_FILE, build_index, write_manifest
from testbed.sweep.spec import SweepSpec, load_sweep

log = logging.getLogger(__name__)

EXECUTORS = ("local", "ray")
LOCK_FILE = ".lock"


@dataclass(frozen=True)
class SweepOptions:
    executor: str = "local"
    """local (child processes on this machine) or ray (one Ray task per run)."""
    jobs: int = 1
    """Runs at once (local); CPUs of the local Ray instance (ray without an address)."""
    address: str | None = None
    """Ray cluster address; ``None``: start a local Ray instance."""
    progress: bool = True
    """Progress bars (a line per finished run is printed either way)."""

    def __post_init__(self) -> None:
        if self.executor not in EXECUTORS:
            raise ValueError(
                f"executor must be one of {', '.join(EXECUTORS)}, got {self.executor!r}"
            )
        if self.jobs < 1:
            raise ValueError(f"jobs must be at least 1, got {self.jobs}")
        if self.address is not None and self.executor != "ray":
            raise ValueError("a Ray address needs the ray executor (--executor ray)")


@dataclass(frozen=True)
class SweepResult:
    sweep_dir: Path
    run_ids: tuple[str, ...]
    """Every run of the sweep, in sweep order."""
    executed: tuple[str, ...]
    """Runs this invocation executed (completed or failed)."""
    skipped: tuple[str, ...]
    """Runs already complete before this invocation."""
    failed: tuple[str, ...]


def run_sweep(sweep: SweepSpec, out: Path, options: SweepOptions = SweepOptions()) -> SweepResult:
    """Runs the sweep's missing runs into ``out/<name>/``, then writes its index (see above)."""
    sweep_dir = Path(out) / sweep.name
    # Before anything is written: the engines of the runs still to do, the executor.
    todo = [run for run in sweep.runs if not is_reusable(sweep_dir / run.run_id, run)]
    require_engines(run.engine for run in todo)
    require_redis(tier for run in todo for tier in run.tiers)
    if options.executor == "ray":
        require_ray()
    sweep_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive(sweep_dir):
        return _run_sweep(sweep, sweep_dir, options)


def _run_sweep(sweep: SweepSpec, sweep_dir: Path, options: SweepOptions) -> SweepResult:
    write_manifest(sweep_dir, sweep)
    todo = []
    for run in sweep.runs:
        differences = reuse_differences(sweep_dir / run.run_id, run)
        if differences == []:
            continue  # finished, and a run of exactly this spec
        if differences:
            log.warning(
                "sweep %s: run %s is finished but not reused (%s); it will be redone",
                sweep.name,
                run.run_id,
                "; ".join(differences),
            )
        todo.append(run)
    todo_ids = {run.run_id for run in todo}
    skipped = tuple(run_id for run_id in sweep.run_ids if run_id not in todo_ids)
    display = _Display(sweep, len(skipped), enabled=options.progress)
    if options.executor == "local":
        outcomes = run_local(todo, sweep_dir, jobs=options.jobs, on_progress=display.run_progress)
    else:
        outcomes = run_ray(todo, sweep_dir, jobs=options.jobs, address=options.address)
    finished: list[RunOutcome] = []
    try:
        with contextlib.closing(outcomes):
            for outcome in outcomes:
                finished.append(outcome)
                display.run_finished(outcome)
    except KeyboardInterrupt:
        build_index(sweep_dir)  # what is finished so far
        raise
    finally:
        display.close()
    build_index(sweep_dir)
    return SweepResult(
        sweep_dir=sweep_dir,
        run_ids=tuple(sweep.run_ids),
        executed=tuple(outcome.run_id for outcome in finished),
        skipped=skipped,
        failed=tuple(outcome.run_id for outcome in finished if not outcome.ok),
    )


@contextlib.contextmanager
def _exclusive(sweep_dir: Path) -> Iterator[None]:
    """Holds the sweep directory's lock: a second invocation would clear runs in progress
    (execute_run redoes unfinished run directories). The OS drops it when the process dies."""
    with open(sweep_dir / LOCK_FILE, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(f"{sweep_dir} is in use by another kvtb sweep") from None
        yield


def run_sweep_command(args: argparse.Namespace) -> int:
    """``kvtb sweep FILE``: 0 when every run is complete, 1 if any failed, 130 when interrupted."""
    sweep = load_sweep(
        resolve_sweep_file(args.file), data_dir(args.data_dir), assignments(args.set)
    )
    jobs = args.jobs or ((os.cpu_count() or 1) if args.executor == "ray" else 1)
    options = SweepOptions(
        executor=args.executor, jobs=jobs, address=args.address, progress=not args.no_progress
    )
    # `kill` and batch schedulers send SIGTERM: stop as orderly as on Ctrl-C.
    try:
        with sigterm_as_interrupt():
            result = run_sweep(sweep, args.out, options)
    except RayMissing as exc:
        print(f"kvtb sweep: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        sweep_dir = Path(args.out) / sweep.name
        complete = sum(is_reusable(sweep_dir / run.run_id, run) for run in sweep.runs)
        print(
            f"\nkvtb sweep: interrupted with {complete} of {len(sweep.runs)} runs complete; "
            "run the same command again to finish the others",
            file=sys.stderr,
        )
        return 130
    print_result(sweep, result)
    return 1 if result.failed else 0


def print_result(sweep: SweepSpec, result: SweepResult) -> None:
    print(
        f"sweep {sweep.name}: {len(result.run_ids)} runs: {len(result.executed)} executed, "
        f"{len(result.skipped)} already complete, {len(result.failed)} failed "
        f"→ {result.sweep_dir / INDEX_FILE}"
    )


class _Display:
    """An overall bar (runs done of all, complete ones counted at once), a bar per running run
    (local executor), and a line per finished run."""

    def __init__(self, sweep: SweepSpec, num_skipped: int, *, enabled: bool) -> None:
        self._enabled = enabled
        self._labels = {run.run_id: _label(run, sweep.label_keys) for run in sweep.runs}
        self._overall = tqdm(
            total=len(sweep.runs),
            initial=num_skipped,
            unit="run",
            desc=f"sweep {sweep.name}",
            disable=None if enabled else True,  # None: only on a terminal
        )
        self._bars: dict[str, tqdm] = {}

    def run_progress(self, spec: RunSpec, done: int, total: int) -> None:
        bar = self._bars.get(spec.run_id)
        if bar is None:
            desc = f"  {spec.run_id} {self._labels[spec.run_id]}"
            bar = tqdm(
                total=total,
                unit="req",
                desc=desc,
                leave=False,
                disable=None if self._enabled else True,
            )
            self._bars[spec.run_id] = bar
        bar.update(done - bar.n)

    def run_finished(self, outcome: RunOutcome) -> None:
        bar = self._bars.pop(outcome.run_id, None)
        if bar is not None:
            bar.close()
        self._overall.update(1)
        status = "complete" if outcome.ok else f"FAILED: {outcome.error}"
        tqdm.write(f"{outcome.run_id} {self._labels[outcome.run_id]}: {status}")

    def close(self) -> None:
        for bar in self._bars.values():
            bar.close()
        self._overall.close()


def _label(run: RunSpec, keys: tuple[str, ...]) -> str:
    """``key=value`` of each key; a trace workload by its kind and file name."""
    values = {key: getattr(run, key) for key in keys}
    if run.workload_digest is not None and "workload" in values:
        kind, _, path = run.workload.partition(":")
        values["workload"] = f"{kind}:{Path(path).stem}"
    return " ".join(f"{key}={value}" for key, value in values.items()) or run.engine
