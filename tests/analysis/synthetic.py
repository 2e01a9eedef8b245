"""Synthetic runs for the accounting tests, shaped as issue 9's telemetry contract says.

A :class:`SyntheticRun` plays every process of a run in one: the engine and the connector's
scheduler side (``kvtb-engine``), one worker per TP rank (``kvtb-worker``, resource
``kvcache.rank``) and a cache server (``kvtb-server``). Spans go through the real
OpenTelemetry SDK, installed by :func:`testbed.core.telemetry.setup.configure_tracing`, into the
run directory's span files; the server's chunk event log is written as the server writes it
(msgpack columnar batches under ``chunks/``).

What the server holds is modelled by :class:`ObjectStore`, which is also the ground truth the
tests compare the analysis with: each request returns a :class:`Admission` saying what its
lookup saw, computed here and not read back from the files.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from testbed.analysis import attribution as acc
from testbed.analysis.chunk_causes import CHUNK_ABSENT, CHUNK_HIT, CHUNK_IN_FLIGHT
from testbed.core.chunk_events import COLUMNS as CHUNK_COLUMNS
from testbed.core.telemetry import attributes as a
from testbed.core.telemetry.setup import Tracing, TracingConfig, configure_tracing

OBJECT_BYTES = 512  # per chunk and KV rank
NAMESPACE_MODEL = "tiny"


def chunk_hashes(labels: Sequence[str]) -> list[bytes]:
    """Rolling prefix hashes of a prompt's complete chunks, one label per chunk."""
    hashes, previous = [], b""
    for label in labels:
        previous = hashlib.blake2b(previous + label.encode(), digest_size=16).digest()
        hashes.append(previous)
    return hashes


@dataclass(frozen=True)
class Prompt:
    """A prompt as chunk labels (equal labels, equal prefix: equal chunk hashes) and the
    length of its incomplete tail chunk."""

    labels: tuple[str, ...]
    tail: int = 0

    def tokens(self, chunk_size: int) -> int:
        return len(self.labels) * chunk_size + self.tail

    @property
    def hashes(self) -> list[bytes]:
        return chunk_hashes(self.labels)


@dataclass
class Admission:
    """What a request's first admission saw (the test's own record)."""

    request_id: str
    session_id: str
    prompt_tokens: int
    engine_hit_tokens: int
    lookup_status: str
    server_hit_tokens: int | None
    promised_tokens: int
    first_failed: dict[int, int | None]
    """Per TP rank with a retrieve item: its first failed token (None: all loaded)."""
    chunk_status: list[str] = field(default_factory=list)
    """Per complete chunk: hit, in_flight or absent at lookup."""
    committed_before: list[bool] = field(default_factory=list)
    """Per complete chunk: whether an object of it had been committed before the lookup."""
    route: tuple[int, tuple[int, ...]] | None = None
    """A fleet's routing decision: the chosen instance and each instance's cached tokens."""
    span: Any = None


class ChunkLog:
    """The server's chunk event log writer: rows in memory, flushed as columnar batches."""

    def __init__(self, path: Path, batch_rows: int = 7) -> None:
        self.path = path
        self.batch_rows = batch_rows
        self.rows: list[dict[str, Any]] = []
        self.seq = 0
        self._encoder = msgspec.msgpack.Encoder()
        path.parent.mkdir(parents=True, exist_ok=True)

    def add(self, event: str, chunk_hash: bytes, time_ns: int, **values: Any) -> None:
        row = {
            **{column.name: column.missing for column in CHUNK_COLUMNS},
            "seq": self.seq,
            "time_ns": time_ns,
            "event": event,
            "chunk_hash": chunk_hash,
            **values,
        }
        self.seq += 1
        self.rows.append(row)
        if len(self.rows) >= self.batch_rows:
            self.flush()

    def flush(self) -> None:
        if not self.rows:
            return
        columns = {name: [row[name] for row in self.rows] for name in self.rows[0]}
        with self.path.open("ab") as stream:
            stream.write(self._encoder.encode({"columns": columns}))
        self.rows = []


class ObjectStore:
    """What the server holds: per (chunk hash, KV rank) reserved or committed objects."""

    def __init__(self, kv_ranks: Sequence[int]) -> None:
        self.kv_ranks = tuple(kv_ranks)
        self.objects: dict[tuple[bytes, int], str] = {}  # -> "reserved" | "committed"
        self.ever_committed: set[bytes] = set()
        self.storer: dict[bytes, str] = {}  # chunk hash -> session that last committed it

    def status(self, chunk_hash: bytes) -> str:
        states = [self.objects.get((chunk_hash, rank)) for rank in self.kv_ranks]
        if all(state == "committed" for state in states):
            return CHUNK_HIT
        if all(state is not None for state in states):
            return CHUNK_IN_FLIGHT
        return CHUNK_ABSENT


class SyntheticRun:
    """One run directory written by hand-driven requests (see the module docstring)."""

    def __init__(
        self,
        run_dir: Path,
        *,
        chunk_size: int = 4,
        tp: int = 1,
        mla: bool = False,
        run_id: str = "synthetic",
        engine_id: str | None = None,
        server: bool = True,
        chunk_log: bool = True,
        server_pid: int = 4242,
        shared_server: SyntheticRun | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.chunk_size = chunk_size
        self.tp = tp
        self.mla = mla
        self.run_id = run_id
        self.engine_id = engine_id or run_id
        self.namespace = f"{NAMESPACE_MODEL}|{tp}|"
        self.admissions: dict[str, Admission] = {}
        self.tier_statuses: dict[bytes, str] = {}
        """Chunk -> the lookup status a server with tiers gives it (``prefetch_timeout``,
        ``tier_read_failed``) in place of the store's."""
        resource = {a.CHUNK_SIZE: chunk_size, a.TP_SIZE: tp, a.MLA: mla}
        self._tracings: list[Tracing] = []
        self.engine = self._tracer("kvtb-engine", None, resource)
        self.workers = [self._tracer("kvtb-worker", rank, resource) for rank in range(tp)]
        if shared_server is not None:
            # Another run's server (its spans and chunk log stay in that run's directory).
            self.server, self.log = shared_server.server, shared_server.log
            self.store, self._clock = shared_server.store, shared_server._clock
            self._pending = shared_server._pending
            return
        self.store = ObjectStore([0] if mla else range(tp))
        self._pending: dict[str, list[tuple[bytes, int]]] = {}  # session -> reserved objects
        self._clock = itertools.count(1_700_000_000_000_000_000, 1_000_000)
        self.server = self._tracer("kvtb-server", None, resource) if server else None
        self.log = (
            ChunkLog(self.run_dir / "chunks" / f"server-{server_pid}.msgpack")
            if server and chunk_log
            else None
        )

    # --- processes -----------------------------------------------------------------------

    def _tracer(self, service: str, rank: int | None, resource: Mapping[str, Any]) -> Any:
        tracing = configure_tracing(
            TracingConfig(
                service_name=service,
                run_dir=self.run_dir,
                run_id=self.run_id,
                rank=rank,
                resource=resource,
            )
        )
        assert tracing is not None, "tracing is off (OTEL_SDK_DISABLED?)"
        self._tracings.append(tracing)
        return tracing.provider.get_tracer("synthetic")

    def close(self) -> Path:
        """Flushes every span file and the chunk log; returns the run directory."""
        for tracing in self._tracings:
            tracing.shutdown()
        if self.log is not None:
            self.log.flush()
        return self.run_dir

    def now(self) -> int:
        return next(self._clock)

    def _span(
        self,
        tracer: Any,
        name: str,
        *,
        parent: Any = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Mapping[str, Any] | None = None,
        error: str | None = None,
        end: bool = True,
    ) -> Any:
        context = trace.set_span_in_context(parent) if parent is not None else None
        span = tracer.start_span(
            name,
            context=context,
            kind=kind,
            attributes=dict(attributes or {}),
            start_time=self.now(),
        )
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        if end:
            span.end(end_time=self.now())
        return span

    def _row(self, event: str, chunk_hash: bytes, **values: Any) -> None:
        if self.log is not None:
            self.log.add(event, chunk_hash, self.now(), namespace=self.namespace, **values)

    # --- the server's operations -----------------------------------------------------------

    def _server_span(self, name: str, parent: Any, **kwargs: Any) -> Any:
        if self.server is None:
            return None
        return self._span(self.server, name, parent=parent, kind=SpanKind.SERVER, **kwargs)

    def lookup(self, session_id: str, hashes: Sequence[bytes], parent: Any) -> Admission:
        span = self._server_span(a.SERVER_LOOKUP, parent, attributes={a.SESSION_ID: session_id})
        span_id = _span_id(span)
        statuses = [self.tier_statuses.get(h) or self.store.status(h) for h in hashes]
        committed = [h in self.store.ever_committed for h in hashes]
        for position, (chunk_hash, status) in enumerate(zip(hashes, statuses, strict=True)):
            self._row(
                "lookup",
                chunk_hash,
                session_id=session_id,
                position=position,
                status=status,
                span_id=span_id,
            )
        admission = Admission("", session_id, 0, 0, acc.LOOKUP_OK, 0, 0, {})
        admission.chunk_status, admission.committed_before = statuses, committed
        hit = next((i for i, s in enumerate(statuses) if s != CHUNK_HIT), len(statuses))
        admission.server_hit_tokens = hit * self.chunk_size
        return admission

    def reserve(
        self,
        session_id: str,
        hashes: Sequence[bytes],
        first: int,
        parent: Any,
        evict: Sequence[bytes] = (),
    ) -> None:
        """Reserves the objects of ``hashes`` (chunk positions from ``first``), after evicting
        ``evict`` for room (an evict span under this store's server span)."""
        span = self._server_span(a.SERVER_STORE, parent, attributes={a.OP: "store_begin"})
        if evict:
            self.evict(evict, parent=span)
        for offset, chunk_hash in enumerate(hashes):
            for rank in self.store.kv_ranks:
                key = (chunk_hash, rank)
                if self.store.objects.get(key) == "committed":
                    self._row(
                        "touch", chunk_hash, kv_rank=rank, session_id=session_id,
                        cause="store", span_id=_span_id(span),
                    )  # fmt: skip
                    continue
                if key in self.store.objects:
                    continue  # another store holds the slot
                self.store.objects[key] = "reserved"
                self._pending.setdefault(session_id, []).append(key)
                self._row(
                    "reserve", chunk_hash, kv_rank=rank, session_id=session_id,
                    position=first + offset, span_id=_span_id(span), nbytes=OBJECT_BYTES,
                )  # fmt: skip

    def commit(self, session_id: str, parent: Any = None, *, ok: bool = True) -> int:
        """Commits (or aborts) the session's reserved objects; returns bytes committed."""
        span = self._server_span(a.SERVER_STORE, parent, attributes={a.OP: "store_commit"})
        committed = 0
        for chunk_hash, rank in self._pending.pop(session_id, []):
            if ok:
                self.store.objects[(chunk_hash, rank)] = "committed"
                self.store.ever_committed.add(chunk_hash)
                self.store.storer[chunk_hash] = session_id
                committed += OBJECT_BYTES
            else:
                del self.store.objects[(chunk_hash, rank)]
            self._row(
                "commit" if ok else "abort", chunk_hash, kv_rank=rank, session_id=session_id,
                span_id=_span_id(span), nbytes=OBJECT_BYTES,
            )  # fmt: skip
        return committed

    def evict(
        self, hashes: Iterable[bytes], *, reason: str = "capacity", parent: Any = None
    ) -> str:
        """Removes every KV rank's object of ``hashes`` (reason capacity: eviction for room;
        drop: an admin or fault drop); returns the evict span's id."""
        hashes = list(hashes)
        num = sum((h, r) in self.store.objects for h in hashes for r in self.store.kv_ranks)
        span = None
        if self.server is not None:
            span = self._span(
                self.server, a.SERVER_EVICT, parent=parent,
                attributes={
                    a.EVICTED_OBJECTS: num, a.EVICTED_BYTES: num * OBJECT_BYTES,
                    a.EVICT_REASON: reason, a.POLICY: "lru",
                },
            )  # fmt: skip
        for chunk_hash in hashes:
            for rank in self.store.kv_ranks:
                if self.store.objects.pop((chunk_hash, rank), None) is None:
                    continue
                self._row(
                    "evict" if reason == "capacity" else "drop", chunk_hash, kv_rank=rank,
                    cause=reason, span_id=_span_id(span), nbytes=OBJECT_BYTES,
                )  # fmt: skip
        return _span_id(span)

    # --- a request ---------------------------------------------------------------------------

    def request(
        self,
        request_id: str,
        prompt: Prompt,
        *,
        engine_hit: int = 0,
        lookup: str = acc.LOOKUP_OK,
        promised: int | None = None,
        retrieve: Mapping[int, int | None | str] | None = None,
        store: str = "commit",
        group: str | None = "g",
        workload_id: str | None = None,
        evict: Sequence[bytes] = (),
        lookup_error: str = "cache server unavailable: no reply within 5.0 s",
        route: tuple[int, Sequence[int]] | None = None,
        hit_by_source: Mapping[str, int] | None = None,
    ) -> Admission:
        """One request's first admission and its stores, as the connector would trace them.

        ``lookup``: ok, unavailable (the server never answered) or none (forced; a prompt
        without a complete chunk gets none by itself). ``promised``: tokens vLLM agreed to
        load (default: what the cache adds beyond ``engine_hit``). ``retrieve``: per TP rank,
        ``None`` (loaded everything), a first failed token, or ``"missing"`` (no item).
        ``store``: commit (store the chunks it computed), reserve (reserved, committed later
        by :meth:`commit`), abort, or none. ``evict``: chunks the store evicts for room first.
        ``route``: a fleet's decision (chosen instance, cached tokens per instance), recorded
        as the fleet records it (a ``kvcache.route`` span under the request's span).
        """
        C = self.chunk_size
        P = prompt.tokens(C)
        hashes = prompt.hashes
        session_id = f"{self.engine_id}:{request_id}"
        engine_span = self._span(
            self.engine, a.REQUEST, end=False,
            attributes={
                a.REQUEST_ID: workload_id or f"w-{request_id}", a.PROMPT_TOKENS: P,
                **({a.REQUEST_GROUP: group} if group else {}),
            },
        )  # fmt: skip
        if route is not None:
            self._span(
                self.engine, a.ROUTE, parent=engine_span,
                attributes={
                    a.REQUEST_ID: workload_id or f"w-{request_id}", a.ROUTER: "synthetic",
                    a.INSTANCE: route[0], a.ROUTE_CLOCK_S: 0.0,
                    a.ROUTE_CACHED_TOKENS: list(route[1]),
                    a.ROUTE_LOAD_TOKENS: [0] * len(route[1]),
                },
            )  # fmt: skip
        request_span = self._span(self.engine, a.CONNECTOR_REQUEST, parent=engine_span, end=False)
        if not hashes:
            lookup = acc.LOOKUP_NONE
        if lookup == acc.LOOKUP_OK:
            lookup_span = self._span(
                self.engine, a.CONNECTOR_LOOKUP, parent=request_span, kind=SpanKind.CLIENT,
                attributes={a.SESSION_ID: session_id, a.OK: True},
            )  # fmt: skip
            admission = self.lookup(session_id, hashes, lookup_span)
        else:
            if lookup in (acc.LOOKUP_UNAVAILABLE, acc.LOOKUP_REFUSED):
                self._span(
                    self.engine, a.CONNECTOR_LOOKUP, parent=request_span, kind=SpanKind.CLIENT,
                    attributes={a.SESSION_ID: session_id, a.OK: False, a.ERROR: lookup_error},
                    error=lookup_error,
                )  # fmt: skip
            admission = Admission("", session_id, 0, 0, lookup, None, 0, {})
            admission.chunk_status = []
        admission.request_id = request_id
        admission.route = None if route is None else (route[0], tuple(route[1]))
        admission.prompt_tokens = P
        admission.engine_hit_tokens = engine_hit
        usable = min(admission.server_hit_tokens or 0, P - 1)
        admission.promised_tokens = max(0, usable - engine_hit) if promised is None else promised
        L = admission.promised_tokens
        if L > 0:
            first_chunk = engine_hit // C
            for rank, worker in enumerate(self.workers):
                outcome = (retrieve or {}).get(rank)
                if outcome == "missing":
                    continue
                item = {
                    a.REQUEST_ID: request_id,
                    a.REQUEST_ATTEMPT: 0,
                    a.RANGE_START: first_chunk * C,
                    a.RANGE_END: (admission.server_hit_tokens or 0),
                    a.SKIP_FIRST_N_TOKENS: engine_hit - first_chunk * C,
                    a.OK: outcome is None,
                }
                if outcome is not None:
                    item[a.FIRST_FAILED_TOKEN] = int(outcome)
                admission.first_failed[rank] = None if outcome is None else int(outcome)
                span = self._span(
                    worker, a.CONNECTOR_RETRIEVE, kind=SpanKind.CLIENT, end=False,
                    attributes={
                        a.NUM_REQUESTS: 1, a.OK: outcome is None,
                        a.BYTES: 0 if outcome is not None else _chunks(L, C) * OBJECT_BYTES,
                    },
                )  # fmt: skip
                span.add_event(a.ITEM_EVENT, item, timestamp=self.now())
                span.end(end_time=self.now())
        if store != "none":
            self._store(request_id, session_id, hashes, admission, store, evict)
        attributes: dict[str, Any] = {
            a.REQUEST_ID: request_id,
            a.SESSION_ID: session_id,
            a.PROMPT_TOKENS: P,
            a.ENGINE_HIT_TOKENS: engine_hit,
            a.PROMISED_TOKENS: L,
            a.LOOKUP_STATUS: admission.lookup_status,
            a.CHUNK_SIZE: C,
            a.BLOCK_SIZE: C,
            a.TP_SIZE: self.tp,
            a.NUM_READERS: self.tp,
            a.PREEMPTIONS: 0,
        }
        if admission.lookup_status == acc.LOOKUP_OK:
            attributes[a.TOKENS_HIT] = admission.server_hit_tokens
            for source, tokens in (hit_by_source or {}).items():
                attributes[a.TOKENS_HIT_BY_SOURCE[source]] = tokens
        request_span.set_attributes(attributes)
        request_span.end(end_time=self.now())
        engine_span.end(end_time=self.now())
        admission.span = request_span
        self.admissions[request_id] = admission
        return admission

    def _store(
        self,
        request_id: str,
        session_id: str,
        hashes: Sequence[bytes],
        admission: Admission,
        mode: str,
        evict: Sequence[bytes] = (),
    ) -> None:
        first = (admission.server_hit_tokens or 0) // self.chunk_size
        if first >= len(hashes):
            return
        storing = list(self.store.kv_ranks) if self.mla else range(self.tp)
        spans = {}
        for rank in storing:
            spans[rank] = self._span(
                self.workers[rank], a.CONNECTOR_STORE, kind=SpanKind.CLIENT, end=False
            )
        self.reserve(session_id, hashes[first:], first, spans[storing[0]], evict)
        committed = 0
        if mode in ("commit", "abort"):
            committed = self.commit(session_id, spans[storing[0]], ok=mode == "commit")
        per_rank = committed // max(1, len(spans))
        for span in spans.values():
            span.add_event(
                a.ITEM_EVENT,
                {
                    a.REQUEST_ID: request_id, a.REQUEST_ATTEMPT: 0,
                    a.RANGE_START: first * self.chunk_size,
                    a.RANGE_END: len(hashes) * self.chunk_size,
                    a.CHUNKS_WRITTEN: len(hashes) - first, a.BYTES: per_rank,
                    a.OK: mode != "abort",
                },
                timestamp=self.now(),
            )  # fmt: skip
            span.set_attributes({a.OK: mode != "abort", a.BYTES: per_rank})
            span.end(end_time=self.now())

    def error_reply(self, request_id: str, message: str = "unknown_id: no such lookup") -> None:
        """An error reply: a connector span of the request marked failed with the reply's
        ``code: message``, over a server span with an error status."""
        parent = self.admissions[request_id].span
        span = self._span(
            self.engine, a.CONNECTOR_LOCK_RELEASE, parent=parent, kind=SpanKind.CLIENT,
            attributes={a.OK: False, a.ERROR: message}, error=message, end=False,
        )  # fmt: skip
        self._server_span(a.SERVER_LOCK_RELEASE, span, error=message)
        span.end(end_time=self.now())

    def connector_failure(self, request_id: str, message: str = "no reply within 5.0 s") -> None:
        """A connector span that failed without an error reply (a timeout)."""
        self._span(
            self.engine, a.CONNECTOR_END_SESSION, parent=self.admissions[request_id].span,
            kind=SpanKind.CLIENT, attributes={a.OK: False, a.ERROR: message}, error=message,
        )  # fmt: skip

    def abandoned(self, request_id: str) -> None:
        """What the connector sends for operations it gave up on: the release of a lookup
        answered too late, and the abort of a store that got no answer."""
        parent = self.admissions[request_id].span
        self._span(
            self.engine, a.CONNECTOR_LOCK_RELEASE, parent=parent, kind=SpanKind.CLIENT,
            attributes={a.OK: False, a.ABANDONED: True},
        )  # fmt: skip
        self._span(
            self.engine, a.CONNECTOR_ABORT, parent=parent, kind=SpanKind.CLIENT,
            attributes={a.OP_ID: 9, a.ABANDONED: True},
        )  # fmt: skip


def _span_id(span: Any) -> str:
    if span is None:
        return ""
    return f"{span.get_span_context().span_id:016x}"


def _chunks(tokens: int, chunk_size: int) -> int:
    return -(-tokens // chunk_size)
