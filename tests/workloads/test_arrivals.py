"""Arrival processes: open-loop times, and closed-loop users paced by the engine's completions."""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import pytest

from testbed.workloads.arrivals import ClosedLoop, OpenLoop, Session, Step, instant_order


@dataclass(frozen=True)
class Item:
    request_id: str
    arrival_s: float = 0.0


def serve(process, service_s: dict[str, float] | float) -> dict[str, tuple[float, float]]:
    """A stand-in engine: every released request takes its service time, all in parallel.
    Returns request id -> (arrival, finish) on the engine's clock."""
    seen: dict[str, tuple[float, float]] = {}
    finishing: list[tuple[float, str]] = []
    clock = 0.0
    while True:
        for item in process.release(clock):
            assert item.arrival_s <= clock
            took = service_s if isinstance(service_s, float) else service_s[item.request_id]
            seen[item.request_id] = (item.arrival_s, clock + took)
            heapq.heappush(finishing, (clock + took, item.request_id))
        upcoming = process.next_arrival_s()
        if not finishing and upcoming is None:
            assert process.waiting() == 0
            return seen
        if finishing and (upcoming is None or finishing[0][0] <= upcoming):
            clock, request_id = heapq.heappop(finishing)
            process.complete(request_id, clock)
        else:
            clock = upcoming


def chain(name: str, delays: list[float]) -> Session:
    steps = [Step(f"{name}{i}", (i - 1,) if i else (), d) for i, d in enumerate(delays)]
    return Session(name, tuple(steps))


def items(*sessions: Session) -> dict[str, Item]:
    return {s.request_id: Item(s.request_id) for session in sessions for s in session.steps}


def test_a_request_arrives_its_think_time_after_the_previous_one_finished():
    session = chain("a", [1.0, 5.0, 2.0])
    seen = serve(ClosedLoop([session], users=1, items=items(session)), 3.0)
    assert seen == {"a0": (1.0, 4.0), "a1": (9.0, 12.0), "a2": (14.0, 17.0)}
    # The same session served instantly: think times alone set the pace.
    order = list(instant_order(ClosedLoop([session], users=1, items=items(session))))
    assert [(i.request_id, i.arrival_s) for i in order] == [("a0", 1), ("a1", 6), ("a2", 8)]


def test_users_replay_one_session_at_a_time_and_take_the_next_one_when_one_ends():
    sessions = [chain("a", [0.0, 1.0]), chain("b", [0.0]), chain("c", [0.5]), chain("d", [0.0])]
    service = {"a0": 2.0, "a1": 2.0, "b0": 1.0, "c0": 10.0, "d0": 1.0}
    seen = serve(ClosedLoop(sessions, users=2, items=items(*sessions)), service)
    assert seen["a0"][0] == seen["b0"][0] == 0.0  # two users start at once
    assert seen["c0"][0] == 1.0 + 0.5  # b ended at 1: its user takes c, which thinks 0.5
    assert seen["a1"] == (3.0, 5.0)
    assert seen["d0"][0] == 5.0  # a ended at 5 (c still runs): its user takes d
    assert set(seen) == set(service)


def test_a_sub_agent_runs_beside_its_parent_and_the_session_ends_when_both_have():
    parent_and_agent = Session(
        "s",
        (
            Step("p0", (), 0.0),
            Step("p1", (0,), 4.0),
            Step("x0", (0,), 1.0),  # spawned 1 s after p0 finished
            Step("x1", (2,), 1.0),
        ),
    )
    after = chain("t", [0.0])
    seen = serve(ClosedLoop([parent_and_agent, after], 1, items(parent_and_agent, after)), 3.0)
    assert seen["p1"] == (7.0, 10.0) and seen["x0"] == (4.0, 7.0) and seen["x1"] == (8.0, 11.0)
    assert seen["t0"][0] == 11.0  # the user's next session: after the last of them


def test_a_request_the_engine_cannot_serve_takes_no_time():
    session = chain("a", [0.0, 2.0, 3.0])
    served = {k: v for k, v in items(session).items() if k != "a1"}
    seen = serve(ClosedLoop([session], users=1, items=served), 1.0)
    assert seen == {"a0": (0.0, 1.0), "a2": (6.0, 7.0)}  # a1 arrived at 3, finished at 3


def test_open_loop_releases_by_time_and_ignores_completions():
    process = OpenLoop([Item("a", 0.0), Item("b", 2.0), Item("c", 2.0)])
    assert process.release(1.0) == [Item("a", 0.0)]
    assert process.next_arrival_s() == 2.0 and process.waiting() == 1
    assert [i.request_id for i in process.release(5.0)] == ["b", "c"]
    assert process.next_arrival_s() is None and process.waiting() == 0


def test_steps_must_wait_on_earlier_steps_and_users_must_exist():
    with pytest.raises(ValueError, match="step 0 waits on a later step"):
        Session("s", (Step("a", (1,), 0.0), Step("b", (), 0.0)))
    with pytest.raises(ValueError, match="users must be >= 1"):
        ClosedLoop([], users=0, items={})
