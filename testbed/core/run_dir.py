"""A run directory and a sweep directory: the name of every file in one, defined once.

A run (``testbed.run.execute_run``) writes into ``<out>/<run_id>/``:

- ``spec.json``: the resolved spec (and the settings the engine ran with, ``effective``);
- ``env.json``: versions, the source's commit, the machine;
- ``spans/``: OTLP JSON lines, ``<service>-<pid>.jsonl`` from each process (with a
  ``.counts.json`` beside each), ``collected-<pid>.jsonl`` from a run's OTLP collector;
- ``chunks/``: the cache servers' chunk-event streams (``server-<pid>.msgpack``), and
  ``chunks.parquet``, the table made of them at the end;
- ``server.log`` (``server-<k>.log`` for a fleet's k-th server), ``vllm.log``
  (``vllm-<k>.log``) for the processes the run started;
- ``metrics.parquet``: one row per request;
- last, ``summary.json``, which marks the run finished; a failed run holds ``error.txt``
  instead (the error on its first line, then the traceback).

A sweep directory holds one run directory per run, ``sweep.json`` (its manifest),
``sweep.toml`` (the sweep file as run) and ``index.parquet`` (one row per run).
:class:`RunDir` and :class:`SweepDir` are those paths; whoever writes or reads one of these
files names it through them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import overload

SPEC = "spec.json"
ENV = "env.json"
SUMMARY = "summary.json"
METRICS = "metrics.parquet"
CHUNKS = "chunks.parquet"
ERROR = "error.txt"
"""A failed run's error (first line) and traceback, written by whoever saw it fail."""
SPANS_DIR = "spans"
CHUNKS_DIR = "chunks"
"""The servers' chunk-event streams: ``<run_dir>/chunks/server-<pid>.msgpack``."""
RESERVE = ".kvtb-reserve"
"""Disk space a run reserves at its start for its results (released before they are written)."""
SWEEP = "sweep.json"
"""A sweep's manifest: its run ids in order, its grid, its description."""
SWEEP_TOML = "sweep.toml"
"""The sweep file as run."""
INDEX = "index.parquet"
"""A sweep's index: one row per run, rebuilt from the run directories."""


class _Entry:
    """A file or directory of a run or sweep directory, by its name: on a ``RunDir(path)``,
    ``path / name``."""

    def __init__(self, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, directory: None, owner: type) -> _Entry: ...
    @overload
    def __get__(self, directory: RunDir | SweepDir, owner: type) -> Path: ...
    def __get__(self, directory: RunDir | SweepDir | None, owner: type) -> Path | _Entry:
        return self if directory is None else directory.path / self.name


@dataclass(frozen=True)
class RunDir:
    """The directory of one run (module docstring)."""

    path: Path

    spec = _Entry(SPEC)
    env = _Entry(ENV)
    summary = _Entry(SUMMARY)
    metrics = _Entry(METRICS)
    chunks = _Entry(CHUNKS)
    error = _Entry(ERROR)
    reserve = _Entry(RESERVE)
    spans = _Entry(SPANS_DIR)
    chunk_streams = _Entry(CHUNKS_DIR)

    def server_log(self, k: int = 0) -> Path:
        """The log of the run's ``k``-th cache server."""
        return self.path / ("server.log" if k == 0 else f"server-{k}.log")

    def vllm_log(self, instance: int | None = None) -> Path:
        """The log of the vLLM server the run started (of a fleet's ``instance``)."""
        return self.path / ("vllm.log" if instance is None else f"vllm-{instance}.log")

    def vllm_metrics(self, instance: int | None = None) -> Path:
        """vLLM's ``/metrics`` as the run's vLLM server (a fleet's ``instance``) answered it
        once the workload was done (Prometheus text)."""
        return self.path / (
            "vllm-metrics.prom" if instance is None else f"vllm-metrics-{instance}.prom"
        )

    def is_complete(self) -> bool:
        """Whether the run finished (``summary.json`` is written last)."""
        return self.summary.is_file()

    def has_spans(self) -> bool:
        """Whether this is a run directory at all (it has ``spans/``)."""
        return self.spans.is_dir()


@dataclass(frozen=True)
class SweepDir:
    """The directory of one sweep: a run directory per run and its manifest."""

    path: Path

    manifest = _Entry(SWEEP)
    source = _Entry(SWEEP_TOML)
    index = _Entry(INDEX)

    def run(self, run_id: str) -> RunDir:
        return RunDir(self.path / run_id)
