"""The access trace: what every cache simulation replays, lookups and references in order.

A trace is a sequence of *steps*. Each step first asks whether some chunk keys are cached
(its queries: one lookup, chunks in position order from position 0), then references some keys
(each reference makes its key the most recent, inserting it if absent). Both halves may be
empty. Where traces come from:

- a workload, with the oracle's semantics (:func:`workload_trace`, :func:`keyed_trace`,
  :func:`hashed_trace`): one step per request whose queries and references are both the
  request's complete chunks (look up the prefix, then walk every chunk);
- a run's chunk event log (``testbed.analysis.whatif.runlog``): one step per settled lookup
  (its rows are the queries; the rows that hit are references, as the server touches them),
  and steps of references only for the commits and touches between lookups.

Keys are dense ints (equal ints = equal chunk identity, namespace included). Every array is a
numpy array so that the what-if's kernels run over them without conversion; the policy
simulations (:mod:`testbed.models.cache_sim`) take :meth:`AccessTrace.request_keys`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from testbed.core.keys import KeyExtras, chunk_hashes

WORKLOAD = "workload"
"""Oracle semantics: a request's hit is its cached prefix of complete chunks."""
RUN = "run"
"""A run's external hit: ``X_r = max(0, min(H_r, P_r - 1) - E_r)`` (METRICS.md, what-if)."""


@dataclass(frozen=True, eq=False)
class AccessTrace:
    """One access stream at one chunk size (see the module docstring)."""

    chunk_size: int
    mode: str
    """:data:`WORKLOAD` or :data:`RUN`: how a request's hit tokens follow from its hit chunks."""
    num_keys: int
    """Keys are ints in ``[0, num_keys)`` (some may be unused after :meth:`rechunk`)."""
    query_offsets: np.ndarray
    """int64 ``[num_steps + 1]``: step ``s``'s queries are ``query_*[off[s]:off[s+1]]``."""
    query_keys: np.ndarray
    query_positions: np.ndarray
    """Chunk index of each query within its request (0, 1, 2, ... within a step)."""
    ref_offsets: np.ndarray
    ref_keys: np.ndarray
    ref_positions: np.ndarray
    step_time_s: np.ndarray
    """float64 seconds of each step (arrival of a workload request; server clock of a run)."""
    step_request: np.ndarray
    """int64: the request whose first lookup a step's queries are, or -1 (a later lookup of a
    preempted request, or a step of references only)."""
    prompt_tokens: np.ndarray
    """int64 per request: ``P_r``."""
    engine_hit_tokens: np.ndarray
    """int64 per request: ``E_r`` (zeros for a workload: the oracle has no engine)."""
    groups: np.ndarray
    """str per request: its workload group (``""`` when the workload has none)."""

    def __post_init__(self) -> None:
        if self.mode not in (WORKLOAD, RUN):
            raise ValueError(f"mode must be {WORKLOAD!r} or {RUN!r}, got {self.mode!r}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, got {self.chunk_size}")
        steps = len(self.step_time_s)
        if len(self.query_offsets) != steps + 1 or len(self.ref_offsets) != steps + 1:
            raise ValueError("query_offsets and ref_offsets need one entry per step plus one")
        if self.query_offsets[-1] != len(self.query_keys) or self.ref_offsets[-1] != len(
            self.ref_keys
        ):
            raise ValueError("the last offsets must equal the number of queries / references")
        if len(self.step_request) != steps:
            raise ValueError("step_request needs one entry per step")
        requests = len(self.prompt_tokens)
        if len(self.engine_hit_tokens) != requests or len(self.groups) != requests:
            raise ValueError("prompt_tokens, engine_hit_tokens and groups need one per request")

    @property
    def num_steps(self) -> int:
        return len(self.step_time_s)

    @property
    def num_requests(self) -> int:
        return len(self.prompt_tokens)

    @property
    def query_request(self) -> np.ndarray:
        """int64 per query: the request it answers for, or -1."""
        return np.repeat(self.step_request, np.diff(self.query_offsets))

    def query_steps(self) -> np.ndarray:
        """int64 per query: its step."""
        return np.repeat(np.arange(self.num_steps, dtype=np.int64), np.diff(self.query_offsets))

    def rechunk(self, factor: int) -> AccessTrace:
        """The same stream at chunk size ``factor * chunk_size``.

        Keys are prefix-chained, so the key of chunk ``j`` at ``k*C`` *is* the key of chunk
        ``k*j + k - 1`` at ``C``: keep the rows at those positions and renumber them. A
        request with ``n`` complete chunks at ``C`` has ``n // k`` at ``k*C``: exactly the
        rows kept. Rows of unknown position (-1) are dropped.
        """
        if factor < 1:
            raise ValueError(f"factor must be a positive integer, got {factor}")
        if factor == 1:
            return self
        query_keep = (self.query_positions >= 0) & ((self.query_positions + 1) % factor == 0)
        ref_keep = (self.ref_positions >= 0) & ((self.ref_positions + 1) % factor == 0)
        return AccessTrace(
            chunk_size=self.chunk_size * factor,
            mode=self.mode,
            num_keys=self.num_keys,
            query_offsets=_kept_offsets(self.query_offsets, query_keep),
            query_keys=self.query_keys[query_keep],
            query_positions=(self.query_positions[query_keep] + 1) // factor - 1,
            ref_offsets=_kept_offsets(self.ref_offsets, ref_keep),
            ref_keys=self.ref_keys[ref_keep],
            ref_positions=(self.ref_positions[ref_keep] + 1) // factor - 1,
            step_time_s=self.step_time_s,
            step_request=self.step_request,
            prompt_tokens=self.prompt_tokens,
            engine_hit_tokens=self.engine_hit_tokens,
            groups=self.groups,
        )

    def at_chunk_size(self, chunk_size: int) -> AccessTrace:
        """:meth:`rechunk` to ``chunk_size``, which must be a multiple of this trace's."""
        if chunk_size % self.chunk_size:
            raise ValueError(
                f"chunk size {chunk_size} is not a multiple of the source's {self.chunk_size}; "
                f"a trace re-chunks to multiples of its own chunk size only"
            )
        return self.rechunk(chunk_size // self.chunk_size)

    def request_key_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`request_keys` as flat arrays ``(keys, offsets)``: request ``r``'s keys are
        ``keys[offsets[r]:offsets[r + 1]]`` (what the simulated cache's kernel reads)."""
        steps = np.flatnonzero(self.step_request >= 0)
        chosen = np.full(self.num_requests, -1, dtype=np.int64)
        np.maximum.at(chosen, self.step_request[steps], steps)  # the last step, as below
        has = chosen >= 0
        starts = np.where(has, self.query_offsets[np.maximum(chosen, 0)], 0)
        lengths = np.where(has, self.query_offsets[np.maximum(chosen, 0) + 1] - starts, 0)
        offsets = np.zeros(self.num_requests + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        index = np.arange(offsets[-1], dtype=np.int64) + np.repeat(starts - offsets[:-1], lengths)
        return self.query_keys[index].astype(np.int64, copy=False), offsets

    def request_keys(self) -> list[list[int]]:
        """Per request, the keys its first lookup asked for (empty if it had none)."""
        keys: list[list[int]] = [[] for _ in range(self.num_requests)]
        flat = self.query_keys.tolist()
        offsets = self.query_offsets.tolist()
        for step in np.flatnonzero(self.step_request >= 0).tolist():
            keys[int(self.step_request[step])] = flat[offsets[step] : offsets[step + 1]]
        return keys


class HashedRequest(Protocol):
    """What :func:`hashed_trace` reads of a request (a workload request)."""

    @property
    def prompt_token_ids(self) -> Sequence[int] | np.ndarray: ...
    @property
    def key_extras(self) -> KeyExtras | None: ...
    @property
    def arrival_s(self) -> float: ...
    @property
    def group(self) -> str: ...


def workload_trace(
    chunk_size: int,
    keys: np.ndarray,
    offsets: np.ndarray,
    num_keys: int,
    prompt_tokens: np.ndarray,
    arrival_s: np.ndarray,
    groups: np.ndarray,
) -> AccessTrace:
    """A trace with the oracle's semantics: per request, look up its keys, then walk them.

    Request ``r``'s complete chunks' keys are ``keys[offsets[r]:offsets[r + 1]]``.
    """
    keys = np.asarray(keys, dtype=np.int64)
    offsets = np.asarray(offsets, dtype=np.int64)
    positions = np.arange(len(keys), dtype=np.int64) - np.repeat(offsets[:-1], np.diff(offsets))
    num_requests = len(offsets) - 1
    return AccessTrace(
        chunk_size=chunk_size,
        mode=WORKLOAD,
        num_keys=num_keys,
        query_offsets=offsets,
        query_keys=keys,
        query_positions=positions,
        ref_offsets=offsets,
        ref_keys=keys,
        ref_positions=positions,
        step_time_s=np.asarray(arrival_s, dtype=np.float64),
        step_request=np.arange(num_requests, dtype=np.int64),
        prompt_tokens=np.asarray(prompt_tokens, dtype=np.int64),
        engine_hit_tokens=np.zeros(num_requests, dtype=np.int64),
        groups=np.asarray(groups, dtype=object),
    )


def keyed_trace(
    chunk_size: int,
    keys: Sequence[Sequence[int]],
    prompt_tokens: Sequence[int],
    arrival_s: Sequence[float] | None = None,
    groups: Sequence[str] | None = None,
) -> AccessTrace:
    """:func:`workload_trace` of per-request key lists (keys: non-negative ints; arrivals
    default to the request's index, groups to ``""``)."""
    counts = [len(request) for request in keys]
    offsets = np.zeros(len(keys) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    flat = np.fromiter(
        (key for request in keys for key in request), dtype=np.int64, count=int(offsets[-1])
    )
    return workload_trace(
        chunk_size,
        flat,
        offsets,
        num_keys=int(flat.max()) + 1 if len(flat) else 0,
        prompt_tokens=np.asarray(prompt_tokens, dtype=np.int64),
        arrival_s=np.asarray(range(len(keys)) if arrival_s is None else arrival_s, np.float64),
        groups=np.asarray([""] * len(keys) if groups is None else groups, dtype=object),
    )


def hashed_trace(requests: Iterable[HashedRequest], chunk_size: int) -> AccessTrace:
    """The trace of ``requests`` keyed as the server keys them: one dense int per distinct
    ``chunk_hashes(prompt, chunk_size)`` value (the request's LoRA and multimodal inputs
    included), complete chunks only."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    ids: dict[bytes, int] = {}
    keys: list[list[int]] = []
    prompt_tokens: list[int] = []
    arrival_s: list[float] = []
    groups: list[str] = []
    for request in requests:
        hashes = chunk_hashes(request.prompt_token_ids, chunk_size, extras=request.key_extras)
        keys.append([ids.setdefault(h, len(ids)) for h in hashes])
        prompt_tokens.append(len(request.prompt_token_ids))
        arrival_s.append(request.arrival_s)
        groups.append(request.group)
    return keyed_trace(chunk_size, keys, prompt_tokens, arrival_s, groups)


def _kept_offsets(offsets: np.ndarray, keep: np.ndarray) -> np.ndarray:
    kept = np.zeros(len(keep) + 1, dtype=np.int64)
    np.cumsum(keep, out=kept[1:])
    return kept[offsets]
