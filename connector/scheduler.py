"""The scheduler side of the connector, over plain types (the vLLM shim converts to these).

Runs in vLLM's scheduler process. It owns the request trackers, asks the planner what to do,
and talks to the server through :class:`connector.scheduler_client.SchedulerClient`. The
hook contracts follow ``KVConnectorBase_V1``:

- :meth:`SchedulerSide.get_num_new_matched_tokens` submits one lookup per request and returns
  ``(None, False)`` until its answer is in; apart from submitting the lookup it has no side
  effects, so the scheduler may call it repeatedly. Against a server whose lookups fill L1
  (``lookups_fill_l1``, a server with tiers) a lookup asked after a load was admitted in the
  same scheduler step is not submitted yet: it answers ``(None, False)`` and vLLM asks again
  next step. The admitted load's chunks still hold L1 (locked) until the load is done, and a
  lookup that brings its hits up from a lower tier needs that room. vLLM asks again for a
  request it already allocated only when it starts that request over (a preemption, or a
  load that failed at its first block): then the tracker starts over too, with a new lookup,
  since the cache's contents may have changed;
- :meth:`SchedulerSide.update_state_after_alloc` decides retrieve or not and frees the locks of
  chunks the engine's own prefix cache holds;
- :meth:`SchedulerSide.build_plan` emits the step's retrieves and the stores of newly
  completed chunks;
- :meth:`SchedulerSide.request_finished` ends the session and says whether vLLM must keep the
  request's blocks until its (asynchronous) stores are done;
- :meth:`SchedulerSide.load_failed` takes the blocks vLLM reports as failed to load (it
  recomputes them): their chunks count as not stored, so the request stores them again once
  recomputed. Chunks computed in the step of a synchronous load are stored only after that
  step reported its loads, so KV computed over blocks that never arrived is never stored.

Telemetry is the record: each request gets one ``kvcache.connector.request`` span (a child of
the request's own trace context when vLLM passes one, else the root of the request's trace),
and every connector span of the request hangs under it. At the request's end the span carries
what its first admission got, the facts ``testbed.analysis`` computes the accounting from:
prompt tokens, vLLM's own hit (E), the server's hit (H), the tokens vLLM agreed to load (L),
the lookup's status and the preemptions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Sequence
from dataclasses import KW_ONLY, dataclass

from connector.ops import StepPlan
from connector.planner import (
    Geometry,
    lock_release_after_alloc,
    plan_retrieve,
    plan_store,
    tokens_to_load,
)
from connector.scheduler_client import ALL_TOKENS, SchedulerClient
from connector.tracker import Admission, Phase, RequestTracker
from testbed.core import telemetry
from testbed.core.hit_sources import split_range
from testbed.core.keys import KeyExtras, chunk_hashes
from testbed.core.telemetry import attributes as a


@dataclass(frozen=True)
class RequestView:
    request_id: str
    token_ids: Sequence[int]
    num_prompt_tokens: int
    num_tokens: int
    cache_salt: str = ""
    traceparent: str = ""
    key_extras: KeyExtras | None = None
    """LoRA adapter and multimodal inputs: part of every chunk key (``testbed.core.keys``)."""


@dataclass(frozen=True)
class ScheduledRequest:
    request_id: str
    num_computed_tokens: int
    """Tokens with KV before this step."""
    num_scheduled_tokens: int
    block_ids: list[int]
    """The request's new blocks, or all of them when ``all_blocks``."""
    all_blocks: bool
    """A new or resumed request: ``block_ids`` is its complete block table."""


@dataclass(eq=False)
class SchedulerSide:
    client: SchedulerClient
    geometry: Geometry
    _: KW_ONLY
    engine_id: str
    default_cache_salt: str = ""
    load_async: bool = True
    lookup_wait_s: float = 0.0
    wait_pending: bool = True
    """Whether a ``pending`` answer (a store in flight) is waited for within
    ``lookup_wait_s``, or the request deferred to the next step at once."""
    store_decode_tokens: bool = False
    tp_size: int = 1
    lookups_fill_l1: bool = False
    """The server answers a lookup only once it brought the hit's chunks from its lower tiers
    into L1 (``ServerConfigInfo.lookups_fill_l1``): a lookup asked after a load was admitted in
    the same step waits for the next step, when that load's chunks no longer take L1's room."""

    def __post_init__(self) -> None:
        self.trackers: dict[str, RequestTracker] = {}
        self._spans: dict[str, telemetry.Span] = {}
        self._delayed: list[str] = []
        self._finishing: list[RequestTracker] = []
        """Finished requests whose deferred stores go into the next plan."""
        self._load_admitted = False
        """A load was admitted in this scheduler step (until its plan is built)."""
        self.lookups_after_loads = 0
        """Lookups held back to the next step because a load was admitted before them."""
        self._unwaited: set[str] = set()
        """Requests whose lookup the mirror answered and whose first store is not planned yet:
        it is sent ``after_lookup`` (the server reads the lookup first)."""

    def session_id(self, request_id: str) -> str:
        return f"{self.engine_id}:{request_id}"

    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        tracker = self._tracker(request)
        if tracker.phase is not Phase.LOOKUP:
            self._reset(tracker)
        if tracker.hit_tokens is None:
            if not tracker.chunk_hashes:
                tracker.hit_tokens = 0  # shorter than a chunk: never stored, never hit
            else:
                if not tracker.lookup_submitted and not self._submit_lookup(
                    tracker, request, num_computed_tokens
                ):
                    self.lookups_after_loads += 1
                    return None, False  # vLLM asks again next step
                answer = self.client.lookup_result(
                    tracker.session_id, self.lookup_wait_s, wait_pending=self.wait_pending
                )
                if answer is None:
                    return None, False
                tracker.hit_tokens = answer.hit_chunks * self.geometry.chunk_size
                tracker.hit_tokens_by_source = {
                    source: chunks * self.geometry.chunk_size
                    for source, chunks in answer.hit_chunks_by_tier.items()
                }
                tracker.lookup_ok = answer.ok
                tracker.lookup_refused = answer.refused
                tracker.handle = answer.handle
                tracker.locks_held = answer.hit_chunks > 0
        tracker.engine_hit_tokens = num_computed_tokens
        load = tokens_to_load(tracker.hit_tokens, num_computed_tokens, request.num_tokens)
        return load, load > 0 and self.load_async

    def _submit_lookup(
        self, tracker: RequestTracker, request: RequestView, num_computed_tokens: int
    ) -> bool:
        """Sends the request's lookup; False when it must wait for the next step (a load was
        admitted in this one, and the server's lookups fill L1). With the mirror, a predicted
        hit that would load nothing beyond vLLM's own is the answer at once (the server is
        told, not waited for), in any step."""
        mirror = self.client.mirror
        predicted = None
        answered = False
        if mirror is not None:
            self.client.drain()
            predicted = mirror.predicted_hit(tracker.cache_salt, tracker.chunk_hashes)
            chunk_size = self.geometry.chunk_size
            answered = not tokens_to_load(
                predicted * chunk_size, num_computed_tokens, request.num_tokens
            )
        if not answered and self.lookups_fill_l1 and self._load_admitted:
            return False
        if mirror is not None:
            if answered:
                mirror.stats.answered += 1
                self._unwaited.add(tracker.request_id)
            else:
                mirror.stats.asked += 1
        self.client.submit_lookup(
            tracker.session_id,
            tracker.chunk_hashes,
            cache_salt=tracker.cache_salt,
            parent=tracker.traceparent,
            mirror_hit_chunks=predicted,
            answered=answered,
            engine_hit_tokens=num_computed_tokens,
        )
        tracker.lookup_submitted = True
        return True

    def update_state_after_alloc(
        self, request_id: str, block_ids: list[int], num_external_tokens: int
    ) -> None:
        tracker = self.trackers.get(request_id)
        if tracker is None:
            return
        if len(block_ids) > len(tracker.block_ids):
            tracker.block_ids.extend(block_ids[len(tracker.block_ids) :])
        if tracker.phase is not Phase.LOOKUP or tracker.hit_tokens is None:
            return  # second call of an async load: only the new blocks matter
        if tracker.first_admission is None:
            tracker.first_admission = Admission(
                engine_hit_tokens=tracker.engine_hit_tokens,
                server_hit_tokens=tracker.hit_tokens if tracker.lookup_ok else None,
                promised_tokens=num_external_tokens,
                lookup_status=_status(tracker),
                hit_tokens_by_source=dict(tracker.hit_tokens_by_source),
            )
        self._load_admitted |= num_external_tokens > 0
        release = lock_release_after_alloc(tracker, num_external_tokens, self.geometry)
        self.client.forget_lookup(tracker.session_id)
        if release is not None:
            self.client.free_locks(tracker.session_id, *release, parent=tracker.traceparent)

    def hit_sources(self, request_id: str, num_external_tokens: int) -> dict[str, int]:
        """The ``num_external_tokens`` vLLM accepted for ``request_id`` (after its engine hit)
        split by the tier that held them at match time (:mod:`testbed.core.hit_sources`;
        only non-zero counts; they sum to ``num_external_tokens``)."""
        tracker = self.trackers.get(request_id)
        if tracker is None or num_external_tokens <= 0:
            return {}
        start = tracker.engine_hit_tokens
        counts = split_range(
            start,
            start + num_external_tokens,
            tracker.hit_tokens_by_source,
            tracker.hit_tokens or 0,
        )
        return {source: tokens for source, tokens in counts.items() if tokens}

    def build_plan(
        self, scheduled: Iterable[ScheduledRequest], preempted_ids: Iterable[str] = ()
    ) -> StepPlan:
        plan = StepPlan(delayed_request_ids=self._delayed)
        self._delayed = []
        self._load_admitted = False  # the scheduler's step ends with its plan
        for request_id in preempted_ids:
            tracker = self.trackers.get(request_id)
            if tracker is not None:
                self._reset(tracker)
                plan.cancelled_request_ids.append(request_id)
        loading = set()
        for tracker in self.trackers.values():
            op = plan_retrieve(tracker, self.geometry)
            if op is not None:
                plan.retrieves.append(op)
                loading.add(tracker.request_id)
        carried = [t for t in self.trackers.values() if t.deferred_tokens is not None]
        for step in scheduled:
            tracker = self.trackers.get(step.request_id)
            if tracker is None:
                continue
            if step.all_blocks:
                tracker.block_ids = list(step.block_ids)
            else:
                tracker.block_ids.extend(step.block_ids)
            computed = step.num_computed_tokens + step.num_scheduled_tokens
            if not self.load_async and step.request_id in loading:
                tracker.deferred_tokens = computed  # stored once the load is known good
                continue
            tracker.deferred_tokens = None
            self._plan_store(plan, tracker, computed)
        for tracker in [*carried, *self._finishing]:  # last step's loads were good
            if tracker.deferred_tokens is not None and tracker.request_id not in loading:
                computed, tracker.deferred_tokens = tracker.deferred_tokens, None
                self._plan_store(plan, tracker, computed)
        self._finishing = []
        return plan

    def _plan_store(self, plan: StepPlan, tracker: RequestTracker, computed: int) -> None:
        store = plan_store(
            tracker, self.geometry, computed, store_decode_tokens=self.store_decode_tokens
        )
        if store is not None:
            if tracker.request_id in self._unwaited:
                self._unwaited.discard(tracker.request_id)
                store = dataclasses.replace(store, after_lookup=True)
            plan.stores.append(store)
            tracker.stores_planned = True
            if self.client.mirror is not None:
                self.client.mirror.planned(store.cache_salt, store.chunk_hashes)

    def load_failed(self, block_ids: Collection[int]) -> None:
        """vLLM reports blocks whose load failed and recomputes them: each request's chunks
        from the first one holding such a block count as not stored (its next stores write
        them again), and its deferred stores, computed over them, are dropped."""
        failed = set(block_ids)
        if not failed:
            return
        for tracker in self.trackers.values():
            first = next((i for i, b in enumerate(tracker.block_ids) if b in failed), None)
            if first is None:
                continue
            chunk = first // self.geometry.blocks_per_chunk
            tracker.num_stored_chunks = min(tracker.num_stored_chunks, chunk)
            tracker.deferred_tokens = None

    def request_finished(self, request_id: str, *, failed: bool = False) -> bool:
        """Ends the session and the request's span and forgets the request. True when stores
        of it may still be in flight: vLLM must then keep its blocks until the workers report
        it in ``finished_sending`` (they learn it from the next step's plan).

        ``failed``: vLLM ended the request with an error (``FINISHED_ERROR``; under
        ``kv_load_failure_policy = "fail"``, a load that failed, reported in this same step
        before the connector hears of its blocks). What its last step computed is then never
        stored (it may stand on blocks that never arrived), so only stores planned in earlier
        steps can keep its blocks: a request that failed its first (synchronous) load is
        freed at once, as vLLM frees it."""
        tracker = self.trackers.pop(request_id, None)
        self._unwaited.discard(request_id)
        if tracker is None:
            return False
        # Finished (aborted) before allocation: its lookup's locks would otherwise wait for the
        # TTL. The server handles the free after the lookup, in order.
        # (One still unanswered is released as abandoned when the session ends.)
        if tracker.phase is Phase.LOOKUP and tracker.locks_held:
            self.client.free_locks(tracker.session_id, 0, ALL_TOKENS, parent=tracker.traceparent)
        self.client.end_session(tracker.session_id, parent=tracker.traceparent)
        self._end_span(tracker)
        if tracker.deferred_tokens is not None and not failed:
            self._finishing.append(tracker)  # its load was good: vLLM finished it
            tracker.stores_planned = True
        if tracker.stores_planned:
            self._delayed.append(request_id)
        return tracker.stores_planned

    def close(self) -> None:
        """Ends the spans of requests still tracked (the engine is shutting down)."""
        for tracker in list(self.trackers.values()):
            self._end_span(tracker, finished=False)
        self.trackers.clear()

    def _tracker(self, request: RequestView) -> RequestTracker:
        tracker = self.trackers.get(request.request_id)
        if tracker is None:
            num_prompt = request.num_prompt_tokens
            session_id = self.session_id(request.request_id)
            span = telemetry.start_span(
                a.CONNECTOR_REQUEST,
                parent=request.traceparent,
                attributes={
                    a.REQUEST_ID: request.request_id,
                    a.SESSION_ID: session_id,
                    a.PROMPT_TOKENS: num_prompt,
                    a.CHUNK_SIZE: self.geometry.chunk_size,
                    a.BLOCK_SIZE: self.geometry.block_size,
                    a.TP_SIZE: self.tp_size,
                    a.NUM_READERS: self.client.num_readers,
                },
            )
            self._spans[request.request_id] = span
            tracker = RequestTracker(
                request_id=request.request_id,
                session_id=session_id,
                token_ids=request.token_ids,
                num_prompt_tokens=num_prompt,
                cache_salt=request.cache_salt or self.default_cache_salt,
                traceparent=telemetry.traceparent_of(span) or request.traceparent,
                chunk_hashes=chunk_hashes(
                    request.token_ids,  # no copy of the prompt: num_chunks stops at its end
                    self.geometry.chunk_size,
                    num_chunks=num_prompt // self.geometry.chunk_size,
                    extras=request.key_extras,
                ),
                key_extras=request.key_extras,
            )
            self.trackers[request.request_id] = tracker
        return tracker

    def _reset(self, tracker: RequestTracker) -> None:
        self.client.forget_lookup(tracker.session_id)
        tracker.reset_after_preemption()

    def _end_span(self, tracker: RequestTracker, finished: bool = True) -> None:
        span = self._spans.pop(tracker.request_id, None)
        if span is None:
            return
        first = tracker.first_admission
        attributes: dict[str, object] = {
            a.PREEMPTIONS: tracker.preemptions,
            a.REQUEST_FINISHED: finished,
        }
        if first is not None:
            attributes[a.ENGINE_HIT_TOKENS] = first.engine_hit_tokens
            attributes[a.PROMISED_TOKENS] = first.promised_tokens
            attributes[a.LOOKUP_STATUS] = first.lookup_status
            if first.server_hit_tokens is not None:
                attributes[a.TOKENS_HIT] = first.server_hit_tokens
                for source, tokens in first.hit_tokens_by_source.items():
                    if source in a.TOKENS_HIT_BY_SOURCE:
                        attributes[a.TOKENS_HIT_BY_SOURCE[source]] = tokens
        span.set_attributes(attributes)  # type: ignore[arg-type]
        span.end()


def _status(tracker: RequestTracker) -> str:
    if not tracker.chunk_hashes:
        return "none"
    if tracker.lookup_ok:
        return "ok"
    return "refused" if tracker.lookup_refused else "unavailable"
