"""What an engine is to a run: :class:`EngineEntry` (how to check a spec for it, which cache
servers it talks to, how to run it) and :class:`EngineRun` (what it gets from the run).

The registry (:data:`testbed.run.registry.ENGINES`) maps each engine's name to its entry
(what a spec may ask of it is its row of :mod:`testbed.spec.engines`); the run reads only the
entry, never compares the name. Each engine's glue lives in its own module of
this package and imports its engine (and vLLM) only when it runs, so that the registry stays
light: the oracle runs where vLLM is not installed.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from testbed.core.credentials import ServerEndpoint
from testbed.engine.results import EngineResult, RequestRecord
from testbed.run.options import RunOptions
from testbed.run.plan import RunPlan
from testbed.spec.runspec import RunSpec

if TYPE_CHECKING:
    import pandas as pd

REPLAY_VOCAB = 32_000
"""The token ids a workload draws for engines without a real model's vocabulary."""


class CacheServers(enum.Enum):
    """Which cache server an engine's connector talks to."""

    NONE = "none"
    """None: the engine computes without a cache server (the oracle)."""
    RUN = "run"
    """The run's: the ``--server`` given, else one the run starts (one per instance with
    servers 'per-instance'), stopped after it."""
    OBSERVED = "observed"
    """Someone else's (a running vLLM server's connector): a ``--server`` given is only asked
    for its state after the run."""


class Progress:
    """A run's progress: a bar (unless the run's options turn it off) and the options'
    callbacks. Engines call :meth:`finished` per request (or :meth:`advance`) and
    :meth:`waiting` while a long start holds the first request back."""

    def __init__(self, spec: RunSpec, total: int, options: RunOptions) -> None:
        self.total = total
        self.done = 0
        self.options = options
        self.desc = f"{spec.engine} {spec.run_id}"
        self.bar = tqdm(
            total=total, unit="req", desc=self.desc, disable=not options.progress, leave=False
        )

    def advance(self, count: int) -> None:
        """``count`` more requests are done."""
        self.done += count
        self.bar.update(count)
        if self.options.on_progress is not None:
            self.options.on_progress(self.done, self.total)

    def finished(self, record: RequestRecord) -> None:
        """One request is done (an engine's ``on_finish``)."""
        self.advance(1)

    def waiting(self, text: str | None) -> None:
        """What the run waits for before its first request (``None``: it has begun, and the
        bar's clock starts then, so that a long start does not make an ETA)."""
        if text is None:
            self.bar.set_description_str(self.desc)
            self.bar.reset(self.total)
        else:
            self.bar.set_description_str(f"{self.desc}: {text}")
        if self.options.on_wait is not None:
            self.options.on_wait(text)

    def close(self) -> None:
        self.bar.close()


@dataclass(frozen=True)
class StartedServer:
    """A cache server the run started: where it answers, and its token file (for processes
    the run starts that read their credential from it)."""

    endpoint: ServerEndpoint
    token_file: Path


@dataclass(frozen=True)
class EngineRun:
    """What an engine gets from a run."""

    plan: RunPlan
    """The checked spec, the servable requests and how they arrive."""
    run_dir: Path
    options: RunOptions
    endpoints: Sequence[ServerEndpoint]
    """The run's cache servers (:attr:`CacheServers.RUN`): one shared, or one per instance;
    empty for the other engines."""
    started: Sequence[StartedServer]
    """Those of ``endpoints`` the run started itself (empty with ``--server``)."""
    progress: Progress

    @property
    def spec(self) -> RunSpec:
        return self.plan.spec


def _no_check(spec: RunSpec, options: RunOptions) -> None:
    return None


def _uses_run_server(options: RunOptions) -> CacheServers:
    return CacheServers.RUN


def _profile_bytes_per_token(spec: RunSpec) -> int:
    return spec.kv_profile.stored_bytes_per_token(spec.tp)


def _profile_name(spec: RunSpec) -> str:
    return spec.kv_profile.name


@dataclass(frozen=True)
class EngineEntry:
    """One engine, as a run uses it. Only ``run`` is required; the defaults describe an
    engine of KV profiles that talks to the run's cache server."""

    run: Callable[[EngineRun], EngineResult]
    """Runs the plan's requests and returns what the engine saw (the run counts hits from
    the telemetry afterwards)."""
    check: Callable[[RunSpec, RunOptions], None] = _no_check
    """Raises ``ValueError`` naming what this engine cannot run as asked (before any work)."""
    cache_servers: Callable[[RunOptions], CacheServers] = _uses_run_server
    bytes_per_token: Callable[[RunSpec], int] = _profile_bytes_per_token
    """KV bytes the cache stores per token of the spec's model (all TP ranks)."""
    vocab_size: Callable[[RunSpec], int] = lambda spec: REPLAY_VOCAB
    """The vocabulary a generated workload draws its token ids from."""
    model_name: Callable[[RunSpec], str] = _profile_name
    """The model the run's resource attributes name."""
    engine_kv_bytes: Callable[[RunSpec, int, int], int] | None = None
    """Memory of the engine's own KV pool for (spec, blocks, bytes per token), checked
    against the machine before the run (``testbed.run.footprint``); ``None``: it has none here."""
    engine_pool: bool = True
    """Whether the engine has vLLM's KV pool (sized from the workload when the spec leaves
    ``engine_blocks`` out; the size that ran is recorded)."""
    fleet: bool = False
    """Instances behind a router even with one (their sessions are named per instance)."""
    block_ids: bool = False
    """Reads a block-hash trace's requests as block ids (no tokens synthesised)."""
    takes_endpoints: bool = False
    """Takes ``--endpoint``/``--endpoints``/``--launch`` (running vLLM servers)."""
    request_table: Callable[[RunSpec, EngineResult], pd.DataFrame] | None = None
    """The per-request table from the engine's result alone, for an engine without telemetry
    (the oracle's arithmetic); ``None``: the attribution of the run's spans, joined with what
    the engine knows of each request (``testbed.run.summary``)."""
