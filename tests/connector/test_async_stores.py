"""Asynchronous stores: a repeat that arrives while its predecessor's store is in flight.

The sequence is driven hook by hook against a real server (real sockets, the real scheduler
side and worker client), so the race is reproduced exactly, not by chance: the worker has
submitted the store (``wait_for_save`` returned) and the server has reserved its chunks, but
nothing is committed until the worker's next hook moves the store on.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from connector.scheduler import RequestView
from connector.worker_client import WorkerClient
from testbed.analysis.spans import load_spans
from testbed.core.telemetry import attributes as a
from testbed.core.telemetry.setup import TracingConfig, configure_tracing
from tests.support.cache_harness import Harness

C = 64


def prompt(n: int) -> list[int]:
    return [(7_919 * i + 13) % 50_000 for i in range(n)]


@pytest.fixture
def traced(tmp_path: Path):
    """This process's spans, recorded into a run directory; yields a reader for them."""
    run_dir = tmp_path / "run"
    tracing = configure_tracing(TracingConfig("kvtb-engine", run_dir=run_dir))

    def spans():
        if tracing is not None:
            tracing.force_flush()
        return load_spans(run_dir)

    yield spans
    if tracing is not None:
        tracing.shutdown()


def _store_in_flight(h: Harness, request_id: str, tokens: list[int]) -> WorkerClient:
    """``first`` computed and its stores submitted; returns once the server has answered the
    store's plan (its chunks reserved, and server-driven, copied) without committing it."""
    h.matched(request_id, tokens)
    blocks = list(range(len(tokens) // 16 + 1))
    h.side.update_state_after_alloc(request_id, blocks, 0)
    plan = h.compute(request_id, 0, len(tokens), blocks, True)
    worker = h.ranks[0].client
    worker.submit_stores(plan.stores)  # wait_for_save: returns at once
    (store,) = worker.stores.inflight
    assert store.future is not None
    store.future.result(5.0)  # the plan is in; the commit is sent by the next hook
    assert worker.pending_store_requests == {request_id}
    return worker


def _ask(h: Harness, view: RequestView) -> int | None:
    """``get_num_new_matched_tokens`` as vLLM asks it each step, deferring pending lookups."""
    loaded, _ = h.side.get_num_new_matched_tokens(view, 0)
    return loaded


@pytest.mark.parametrize("mode", ["worker", "server"])
def test_a_repeat_before_the_commit_is_pending_then_hits_once_the_store_commits(
    start_server, traced, mode
):
    server = start_server("--chunk-size", str(C), "--lookup-pending-timeout", "30")
    tokens = prompt(3 * C + 5)
    with Harness(server, transfer_mode=mode) as h:
        worker = _store_in_flight(h, "first", tokens)
        # vLLM must keep the finished request's blocks: its store is still in flight.
        assert h.side.request_finished("first") is True
        h.side.wait_pending = False  # stores on their own timing: never wait in the scheduler
        view = RequestView("repeat", tokens, len(tokens), len(tokens))
        assert _ask(h, view) is None  # pending: asked again next step
        assert _ask(h, view) is None  # still pending: nothing committed yet
        worker.progress_stores(5.0)  # the worker's next hook: commit
        assert worker.pending_store_requests == set()
        # The poll sent before the commit may still answer pending; the next finds every
        # chunk committed.
        loaded = _ask(h, view)
        assert (loaded if loaded is not None else _ask(h, view)) == 3 * C
        h.side.request_finished("repeat")
    spans = traced()
    lookups = spans[spans["name"] == a.CONNECTOR_LOOKUP]
    repeat = lookups[lookups[a.SESSION_ID] == "engine:repeat"].iloc[0]
    assert repeat[a.LOOKUP_POLLS] >= 2 and repeat[a.TOKENS_HIT] == 3 * C
    assert repeat[a.SERVER_MS] > 0 and repeat[a.POLL_WAIT_MS] >= 0
    store = spans[spans["name"] == a.CONNECTOR_STORE].iloc[0]
    assert store[a.OK] and store[a.SERVER_COPIED] == (mode == "server")


def test_a_repeat_whose_store_does_not_commit_in_time_misses_as_in_flight(start_server, traced):
    server = start_server("--chunk-size", str(C), "--lookup-pending-timeout", "0.3")
    tokens = prompt(3 * C + 5)
    with Harness(server) as h:
        worker = _store_in_flight(h, "first", tokens)
        h.side.request_finished("first")
        h.side.wait_pending = False
        view = RequestView("repeat", tokens, len(tokens), len(tokens))
        answers = []
        deadline = time.monotonic() + 10
        while (loaded := _ask(h, view)) is None and time.monotonic() < deadline:
            answers.append(loaded)
            time.sleep(0.05)  # steps go by; the worker never gets to commit
        assert answers and loaded == 0  # pending, then settled as a miss
        h.side.request_finished("repeat")
        worker.progress_stores(5.0)  # the store commits after all: a later request hits
        late = RequestView("late", tokens, len(tokens), len(tokens))
        assert _ask(h, late) == 3 * C
        h.side.request_finished("late")
    spans = traced()
    lookups = spans[spans["name"] == a.CONNECTOR_LOOKUP].set_index(a.SESSION_ID)
    assert lookups.loc["engine:repeat", a.MISS_STATUS] == "in_flight"
    assert lookups.loc["engine:repeat", a.LOOKUP_POLLS] >= 1
    assert lookups.loc["engine:late", a.TOKENS_HIT] == 3 * C


def test_a_preempted_requests_store_is_dropped_before_its_blocks_are_reused(start_server):
    server = start_server("--chunk-size", str(C))
    tokens = prompt(3 * C + 5)
    with Harness(server) as h:
        h.matched("first", tokens)
        blocks = list(range(13))
        h.side.update_state_after_alloc("first", blocks, 0)
        plan = h.compute("first", 0, len(tokens), blocks, True)
        worker = h.ranks[0].client
        worker.submit_stores(plan.stores)
        worker.cancel_stores(["first"])  # handle_preemptions, before the next forward pass
        worker.progress_stores(5.0)
        assert worker.pending_store_requests == set() and worker.stores_failed == 1
        stats = h.stats()
        assert stats.num_objects == 0  # nothing of it committed
        assert h.matched("again", tokens) == 0
