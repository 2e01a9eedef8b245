"""Why did this request miss? One request's story, from its spans and the chunk log.

:func:`explain` (or :class:`Explainer` for many requests of one run) returns a
:class:`RequestStory`: the request's lookup (server hit ``H``, each chunk's status), where its
prompt tokens went as token ranges (the categories of :mod:`testbed.analysis.attribution`),
and the first token the engine had to compute, with why:

- ``capacity``: the evict (or drop) span that removed the chunk, and the request that had
  stored it (the commit row's session id, ``"{engine_id}:{request_id}"``);
- ``cold``: no request had stored the chunk before this lookup (and who stored it later);
- ``in_flight``: the request whose store had reserved the chunk but not committed it;
- ``load_failed``: the ranks whose retrieve failed, their first failed tokens, ranks with no
  retrieve at all, and the span that removed the chunk after the lookup if the log shows one;
- ``unavailable``: the lookup's error;
- ``routing`` (fleets): the instance whose prefix cache held the tokens when the request
  arrived, and the router's costs for its choice;
- ``engine_only``, ``partial_chunk``, ``last_token``: what the arithmetic says.

The story's types and its text are :mod:`testbed.analysis.explain_story`'s; ``str(story)`` is
the readable form ``kvtb explain RUN REQUEST_ID`` prints.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path

import numpy as np
import pandas as pd

from testbed.analysis import attribution as acc
from testbed.analysis.chunk_causes import CHUNK_HIT, first_lookup_rows, object_keys
from testbed.analysis.explain_story import (
    ChunkLookup,
    Miss,
    PeerCopy,
    RequestStory,
    Route,
    Segment,
    per_instance,
    segments,
)
from testbed.analysis.request_ids import examples, find_rows
from testbed.analysis.routing import route_table
from testbed.analysis.spans import is_run_dir
from testbed.analysis.tables import Run
from testbed.core.telemetry import attributes as a

_HITS = ("engine", "external")
_REMOVALS = ("evict", "drop", "expire")


def explain(run: Run | Path | str, request_id: str) -> RequestStory:
    """The story of one request of one run: ``request_id`` is vLLM's (the connector span's),
    the workload's (the engine span's), the session id or the id a client of vLLM's OpenAI
    server saw. A sweep holds many runs: :func:`testbed.analysis.explain_runs.explain_runs`."""
    return Explainer(run).explain(request_id)


class Explainer:
    """Stories of the requests of one run (the run's tables are computed once)."""

    def __init__(self, run: Run | Path | str) -> None:
        self.run = acc.as_run(run)
        if not is_run_dir(self.run.path):
            raise LookupError(
                f"{self.run.path} is not a run directory (no spans/): for a sweep, "
                "explain_runs(SWEEP, REQUEST_ID), or kvtb explain SWEEP REQUEST_ID [--run RUN]"
            )

    @cached_property
    def attribution(self) -> pd.DataFrame:
        return acc.attribute(self.requests, self.run.spans, self.run.events, self.run.chunks)

    @cached_property
    def requests(self) -> pd.DataFrame:
        return acc.connector_requests(self.run.spans)

    @cached_property
    def lookups(self) -> pd.DataFrame:
        chunks = self.run.chunks
        return first_lookup_rows(chunks) if chunks is not None else pd.DataFrame()

    @cached_property
    def routes(self) -> pd.DataFrame:
        return route_table(self.run.spans).set_index("workload_request_id", drop=False)

    @cached_property
    def items(self) -> pd.DataFrame:
        return acc.retrieve_items(self.run.spans, self.run.events)

    @cached_property
    def _keys(self) -> np.ndarray:
        chunks = self.run.chunks
        return object_keys(chunks) if chunks is not None else np.empty(0, dtype=np.int64)

    def find(self, request_id: str) -> int:
        """The row of ``request_id``: vLLM's id, the workload's, the session id, or the id a
        client of vLLM's OpenAI server saw (its first choice; :mod:`.request_ids`)."""
        table = self.attribution
        rows = find_rows(table, request_id)
        if rows:
            return rows[0]
        raise LookupError(
            f"no request {request_id!r} in {self.run.path}: give vLLM's request id, the "
            f"workload's, the session id or the id a client saw ({len(table)} requests have "
            f"connector spans: {examples(table)})"
        )

    def explain(self, request_id: str) -> RequestStory:
        row = self.attribution.iloc[self.find(request_id)]
        chunks = self._chunk_lookups(str(row["session_id"]))
        route = self._route(row)
        ranges = segments(row, chunks, route)
        first = next((s for s in ranges if s.category not in _HITS), None)
        hit = row["server_hit_tokens"]
        return RequestStory(
            request_id=str(row["request_id"]),
            workload_request_id=_text(row["workload_request_id"]),
            session_id=str(row["session_id"]),
            group=_text(row["group"]),
            trace_id=str(row["trace_id"]),
            prompt_tokens=int(row["prompt_tokens"]),
            chunk_size=int(row["chunk_size"]),
            tp_size=int(row["tp_size"]),
            engine_hit_tokens=int(row["engine_hit_tokens"]),
            server_hit_tokens=None if pd.isna(hit) else int(hit),
            promised_tokens=int(row["promised_tokens"]),
            external_hit_tokens=int(row["external_hit_tokens"]),
            lookup_status=str(row["lookup_status"]),
            tokens={name: int(row[name]) for name in acc.CATEGORIES},
            segments=tuple(ranges),
            lookup=tuple(chunks),
            first_miss=None if first is None else self._miss(row, first, chunks, route),
            causes_resolved=bool(row["causes_resolved"]),
            route=route,
            external_by_source={
                name.removeprefix("external_"): int(row[name]) for name in acc.EXTERNAL_BY_SOURCE
            },
            tier_traffic=self._tier_traffic(),
            peer_copies=self._peer_copies(str(row["trace_id"])),
        )

    def _peer_copies(self, trace_id: str) -> tuple[PeerCopy, ...]:
        """The copies peers made for the request's lookups (its trace's peer fetch spans)."""
        spans = self.run.spans
        if not len(spans) or a.PEER not in spans:
            return ()
        rows = spans[(spans["name"] == a.SERVER_PEER_FETCH) & (spans["trace_id"] == trace_id)]
        rows = rows[rows[a.PEER].notna() & (rows[a.CHUNKS].fillna(0) > 0)]
        return tuple(
            PeerCopy(
                peer=str(r[a.PEER]),
                url=str(r[a.SERVER_URL]),
                chunks=int(r[a.CHUNKS]),
                nbytes=int(r[a.BYTES]),
                wait_ms=float(r[a.PEER_WAIT_MS]),
            )
            for _, r in rows.iterrows()
        )

    def _tier_traffic(self) -> dict | None:
        """summary.json's ``server_tiers`` and ``server_tier_lookups`` (``None``: no tiers,
        or no summary yet)."""
        path = self.run.path / "summary.json"
        if not path.is_file():
            return None
        try:
            summary = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        flat = summary.get("server_tiers")
        if not flat:
            return None
        levels: dict[str, dict] = {}
        for key, value in flat.items():  # <tier>_<count> (L2_reads, ...): by tier again
            tier, _, count = key.partition("_")
            levels.setdefault(tier, {})[count] = value
        return {"levels": levels, **(summary.get("server_tier_lookups") or {})}

    def _route(self, row: pd.Series) -> Route | None:
        workload_id = _text(row["workload_request_id"])
        if workload_id is None or workload_id not in self.routes.index:
            return None
        route = self.routes.loc[workload_id]
        costs = route["costs"]
        return Route(
            router=str(route["router"]),
            instance=int(route["instance"]),
            cached_tokens=tuple(int(t) for t in route["cached_tokens"]),
            costs=None if costs is None else tuple(float(c) for c in costs),
            load_tokens=tuple(float(t) for t in route["load_tokens"]),
        )

    # --- the first miss ----------------------------------------------------------------------

    def _chunk_lookups(self, session_id: str) -> list[ChunkLookup]:
        if self.lookups.empty:
            return []
        rows = self.lookups[self.lookups["session_id"] == session_id]
        return [
            ChunkLookup(int(r.position), str(r.status), str(r.cause), str(r.effective))
            for r in rows.itertuples()
        ]

    def _miss(
        self, row: pd.Series, segment: Segment, chunks: list[ChunkLookup], route: Route | None
    ) -> Miss:
        C, P = int(row["chunk_size"]), int(row["prompt_tokens"])
        start, cause = segment.start_token, segment.category
        position = start // C
        if cause == "routing" and route is not None:
            return _routing_miss(segment, route)
        if cause == "last_token":
            return Miss(cause, start, None, "vLLM always computes the last prompt token itself.")
        if cause == "partial_chunk":
            return Miss(
                cause,
                start,
                position,
                f"tokens [{start}, {P - 1}) lie in the prompt's incomplete last chunk "
                f"(chunk size {C}): never stored, never looked up.",
            )
        if cause == "engine_only":
            return Miss(
                cause,
                start,
                position,
                f"the server held {int(row['server_hit_tokens'])} tokens at lookup, but vLLM "
                f"loaded only {int(row['promised_tokens'])} tokens beyond its own hit of "
                f"{int(row['engine_hit_tokens'])}: vLLM's prefix cache or its block allocation "
                "decided, and nothing more was loaded.",
            )
        if cause in ("unavailable", "refused"):
            error = self._lookup_error(row)
            return Miss(
                cause,
                start,
                position,
                f"the lookup did not succeed ({error or 'no reply'}); the request ran without "
                "the cache.",
                lookup_error=error,
            )
        if cause == "load_failed":
            return self._load_failed(row, start)
        return self._chunk_miss(row, start, cause, position, chunks)

    def _chunk_miss(
        self, row: pd.Series, start: int, cause: str, position: int, chunks: list[ChunkLookup]
    ) -> Miss:
        source = _source_chunk(chunks, position)
        if source is None:
            return Miss(
                cause,
                start,
                position,
                "the chunk log has no lookup of this request: the chunk counts as cold.",
            )
        lookup = self._lookup_row(str(row["session_id"]), source)
        assert lookup is not None  # the chunk's lookup row is where its cause came from
        history = self._history(int(lookup["object_key"]))
        before = history[history["seq"] < lookup["seq"]]
        after = history[history["seq"] > lookup["seq"]]
        chunk_hash = _hex(lookup["chunk_hash"]) if "chunk_hash" in lookup else None
        label = f"chunk {source} ({chunk_hash[:16]}…)" if chunk_hash else f"chunk {source}"
        if cause == "capacity":
            commits = before[before["event"] == "commit"]
            committed_seq = commits["seq"].iloc[-1] if len(commits) else -1
            removals = before[before["event"].isin(_REMOVALS) & (before["seq"] > committed_seq)]
            removal = removals.iloc[0] if len(removals) else None
            storer = self._storer(str(commits["session_id"].iloc[-1]) if len(commits) else "")
            removed = (
                "it was gone before the lookup, with no evict or drop row in the log"
                if removal is None
                else f"{_removal_text(str(removal['event']))} by span {removal['span_id']}"
            )
            return Miss(
                cause, start, source,
                f"{label} was stored by {_request_text(storer)} and {removed} before this lookup.",
                chunk_hash=chunk_hash,
                evict_span_id=None if removal is None else str(removal["span_id"]),
                evict_cause=None if removal is None else _removal_cause(removal),
                storer_session_id=storer[0], storer_request_id=storer[1],
                storer_workload_request_id=storer[2],
            )  # fmt: skip
        if cause == "in_flight":
            reserves = before[before["event"] == "reserve"]
            session = str(reserves.iloc[-1]["session_id"]) if len(reserves) else ""
            storer = self._storer(session)
            commits = after[(after["event"] == "commit") & (after["session_id"] == session)]
            when = " (it committed after the lookup)" if len(commits) else ""
            return Miss(
                cause, start, source,
                f"{label} was being stored by {_request_text(storer)}: reserved, not yet "
                f"committed, when this request looked it up{when}.",
                chunk_hash=chunk_hash, storer_session_id=storer[0] or None,
                storer_request_id=storer[1], storer_workload_request_id=storer[2],
            )  # fmt: skip
        aborted = before[before["event"] == "abort"]
        later = after[after["event"] == "commit"]
        reason = f"no earlier request stored {label} before this lookup"
        if len(aborted):
            reason += f" (a store by session {aborted.iloc[-1]['session_id']} was aborted)"
        if len(later):
            reason += f"; it was first stored afterwards by session {later.iloc[0]['session_id']}"
        return Miss(cause, start, source, reason + ".", chunk_hash=chunk_hash)

    def _load_failed(self, row: pd.Series, start: int) -> Miss:
        C, tp = int(row["chunk_size"]), int(row["tp_size"])
        items = self.items[self.items["request_id"] == str(row["request_id"])]
        failed = items[items["failed"]]
        per_rank = failed.groupby("rank")["first_failed_token"].min()
        ranks = {int(r): int(t) for r, t in per_rank.items()}
        missing = tuple(sorted(set(range(tp)) - set(items["rank"].astype(int))))
        parts = [f"rank {r} failed from token {t}" for r, t in ranks.items()]
        parts += [f"rank {r} sent no retrieve" for r in missing]
        position = start // C
        reason = (
            f"vLLM was promised tokens [{int(row['engine_hit_tokens'])}, "
            f"{int(row['engine_hit_tokens']) + int(row['promised_tokens'])}) but "
            + (", ".join(parts) or "the load failed")
            + f"; vLLM recomputes from the first failed block (token {start})."
        )
        evict_span_id = evict_cause = None
        lookup = self._lookup_row(str(row["session_id"]), position)
        if lookup is not None:
            history = self._history(int(lookup["object_key"]))
            removals = history[history["event"].isin(_REMOVALS) & (history["seq"] > lookup["seq"])]
            if len(removals):
                removal = removals.iloc[0]
                evict_span_id, evict_cause = str(removal["span_id"]), _removal_cause(removal)
                reason += (
                    f" The chunk was {_removal_text(str(removal['event']))} by span "
                    f"{evict_span_id} after the lookup."
                )
        return Miss(
            "load_failed", start, position, reason,
            evict_span_id=evict_span_id, evict_cause=evict_cause, failed_ranks=ranks,
            missing_ranks=missing,
            retrieve_span_ids=tuple(dict.fromkeys(items["span_id"].astype(str))),
        )  # fmt: skip

    # --- lookups into the tables -------------------------------------------------------------

    def _lookup_row(self, session_id: str, position: int) -> pd.Series | None:
        if self.lookups.empty:
            return None
        rows = self.lookups[
            (self.lookups["session_id"] == session_id) & (self.lookups["position"] == position)
        ]
        if rows.empty:
            return None
        lookup = rows.iloc[0].copy()
        chunks = self.run.chunks
        assert chunks is not None
        match = chunks[
            (chunks["event"] == "lookup")
            & (chunks["seq"] == lookup["seq"])
            & (chunks["server"] == lookup["server"])
        ]
        lookup["chunk_hash"] = match["chunk_hash"].iloc[0] if len(match) else None
        return lookup

    def _history(self, object_key: int) -> pd.DataFrame:
        """Every log row about one object (all KV ranks), in order."""
        chunks = self.run.chunks
        assert chunks is not None
        return chunks[self._keys == object_key].sort_values("seq", kind="stable")

    def _storer(self, session_id: str) -> tuple[str, str | None, str | None]:
        """(session id, vLLM request id, workload request id) of a session."""
        if not session_id:
            return "", None, None
        request_id = session_id.partition(":")[2] or session_id
        table = self.attribution
        match = table[table["session_id"] == session_id]
        workload = _text(match["workload_request_id"].iloc[0]) if len(match) else None
        return session_id, request_id, workload

    def _lookup_error(self, row: pd.Series) -> str | None:
        spans = self.run.spans
        lookups = spans[
            (spans["name"] == a.CONNECTOR_LOOKUP) & (spans["parent_span_id"] == row["span_id"])
        ]
        for _, lookup in lookups.iterrows():
            error = _text(lookup.get(a.ERROR)) or _text(lookup.get("status_message"))
            if error:
                return error
        return None


def _routing_miss(segment: Segment, route: Route) -> Miss:
    held = route.cached_tokens
    holder = max((i for i in range(len(held)) if i != route.instance), key=lambda i: (held[i], -i))
    reason = (
        f"instance {holder}'s prefix cache held the prompt's first {held[holder]} tokens when "
        f"the request arrived; {route.router} sent it to instance {route.instance}, which held "
        f"{held[route.instance]}, and tokens [{segment.start_token}, {segment.end_token}) were "
        "computed there"
    )
    if route.costs is not None:
        reason += f" (costs {per_instance(route.costs)}: the lowest wins)"
    return Miss("routing", segment.start_token, None, reason + ".", holder_instance=holder)


def _source_chunk(chunks: list[ChunkLookup], position: int) -> int | None:
    """The chunk whose own miss explains ``position``: itself, or for a hit behind a miss the
    nearest earlier chunk that missed."""
    own = {c.position: c for c in chunks}
    for candidate in range(position, -1, -1):
        chunk = own.get(candidate)
        if chunk is None:
            return None
        if chunk.cause != CHUNK_HIT:
            return candidate
    return None


def _request_text(storer: tuple[str, str | None, str | None]) -> str:
    session, request_id, workload = storer
    if not session:
        return "an unknown request"
    names = [f"workload {workload}"] if workload else []
    return f"request {request_id} ({', '.join([*names, f'session {session}'])})"


def _removal_text(event: str) -> str:
    return {"evict": "evicted for room", "drop": "dropped", "expire": "expired"}.get(event, event)


def _removal_cause(removal: pd.Series) -> str:
    return str(removal["cause"]) or str(removal["event"])


def _hex(value: object) -> str | None:
    return value.hex() if isinstance(value, bytes | bytearray) else None


def _text(value: object) -> str | None:
    if value is None or (not isinstance(value, str) and bool(pd.isna(value))):
        return None
    text = str(value)
    return text or None
