"""What the connector did in one interval, for vLLM's connector stats and Prometheus metrics.

Plain data, in both roles: the scheduler side records each lookup, each worker each store and
retrieve batch, when the operation's span ends and with the span's own figures (its duration
is the span's end minus its start, both taken from one clock reading each), so that the
metrics' totals equal the totals of the run's spans. vLLM takes one interval per engine step
(``get_kv_connector_stats`` in every worker and in the scheduler), sums the TP workers' and
the scheduler's (``KVConnectorStats.aggregate``: counters add, latency samples concatenate)
and hands the result to the Prometheus metrics in the API server process.

An interval is a ``dict`` (vLLM sends stats between processes as plain data): the counters of
:data:`COUNTERS` and the latency samples (seconds) of :data:`SAMPLES`.
"""

from __future__ import annotations

from typing import Any

StatsData = dict[str, Any]

COUNTERS = (
    "lookups",
    "lookup_failures",
    "lookup_requested_tokens",
    "lookup_hit_tokens",
    "stores",
    "store_failures",
    "stored_bytes",
    "retrieves",
    "retrieve_failures",
    "retrieved_bytes",
    "abandoned_releases",
)
"""Counts: lookups (connector lookup spans) and those that failed (server down, timed out,
refused); tokens asked for and hit (``kvcache.tokens.{requested,hit}``); store and retrieve
batches (connector store / retrieve spans, one per TP rank) and those not ``kvcache.ok``; bytes
stored and retrieved (``kvcache.bytes``); releases sent for abandoned operations."""

_BYTES = {"store": "stored_bytes", "retrieve": "retrieved_bytes"}

SAMPLES = ("lookup_s", "store_s", "retrieve_s")
"""Durations in seconds of each lookup, store and retrieve span of the interval."""


def empty() -> StatsData:
    return {**dict.fromkeys(COUNTERS, 0), **{name: [] for name in SAMPLES}}


def is_empty(data: StatsData) -> bool:
    return not any(data.get(name) for name in (*COUNTERS, *SAMPLES))


def merge(into: StatsData, other: StatsData) -> StatsData:
    """Adds ``other``'s counts and samples to ``into`` (another rank's, or a later interval's);
    returns ``into``. Unknown keys are an error: both sides must run the same connector."""
    unknown = set(other) - set(COUNTERS) - set(SAMPLES)
    if unknown:
        raise ValueError(f"unknown connector stats {sorted(unknown)}")
    for name in COUNTERS:
        into[name] = into.get(name, 0) + other.get(name, 0)
    for name in SAMPLES:
        into[name] = [*into.get(name, ()), *other.get(name, ())]
    return into


def summary(data: StatsData) -> dict[str, int | float]:
    """One interval in a few numbers (vLLM logs them): the counts, and per operation the
    number of spans and their mean duration in milliseconds."""
    reduced: dict[str, int | float] = {name: data.get(name, 0) for name in COUNTERS}
    for name in SAMPLES:
        samples = data.get(name, [])
        operation = name.removesuffix("_s")
        reduced[f"{operation}_mean_ms"] = 1e3 * sum(samples) / len(samples) if samples else 0.0
    return reduced


class StatsRecorder:
    """Collects one process's operations until vLLM takes them (one role's thread)."""

    def __init__(self) -> None:
        self._data = empty()
        self._recorded = False
        """Whether anything was recorded since the last :meth:`take` (vLLM asks every step)."""

    def lookup(self, *, requested_tokens: int, hit_tokens: int, ok: bool, seconds: float) -> None:
        self._recorded = True
        data = self._data
        data["lookups"] += 1
        data["lookup_failures"] += not ok
        data["lookup_requested_tokens"] += requested_tokens
        data["lookup_hit_tokens"] += hit_tokens
        data["lookup_s"].append(seconds)

    def store(self, *, nbytes: int, ok: bool, seconds: float) -> None:
        self._transfer("store", nbytes, ok, seconds)

    def retrieve(self, *, nbytes: int, ok: bool, seconds: float) -> None:
        self._transfer("retrieve", nbytes, ok, seconds)

    def abandoned_release(self) -> None:
        self._recorded = True
        self._data["abandoned_releases"] += 1

    def take(self) -> StatsData | None:
        """The interval since the last call (``None`` when nothing happened)."""
        if not self._recorded:
            return None
        data, self._data, self._recorded = self._data, empty(), False
        return data

    def _transfer(self, operation: str, nbytes: int, ok: bool, seconds: float) -> None:
        self._recorded = True
        data = self._data
        data[f"{operation}s"] += 1
        data[f"{operation}_failures"] += not ok
        data[_BYTES[operation]] += nbytes
        data[f"{operation}_s"].append(seconds)
