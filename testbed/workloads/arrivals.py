"""Arrival processes: when each request of a workload arrives, on the consuming engine's clock.

An engine consumes an :class:`ArrivalProcess`: it asks for the requests that have arrived by
its clock (:meth:`~ArrivalProcess.release`), jumps its clock to the next arrival when it is
idle (:meth:`~ArrivalProcess.next_arrival_s`), and reports every request it finished or
refused (:meth:`~ArrivalProcess.complete`), each at its own clock. Two processes:

- :class:`OpenLoop`: arrivals fixed in advance (a trace's timestamps, a generator's Poisson
  times); completions change nothing.
- :class:`ClosedLoop`: ``users`` concurrent users. Each replays one session at a time; a
  session is a set of :class:`Step` s, each arriving its ``delay_s`` (the think time) after the
  steps it waits for have finished, on the engine's clock; when every step of a session has
  finished, its user takes the next session of the queue.

Both are pure (no engine, no vLLM): a replay, a fleet of replays on one virtual clock, or the
oracle (:func:`instant_order`: every request finishes the moment it arrives) drive the same
object. Arrival times are stamped on the released items (``dataclasses.replace(item,
arrival_s=...)``), so items are any frozen dataclasses with ``request_id`` and ``arrival_s``.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar, runtime_checkable


class Arriving(Protocol):
    @property
    def request_id(self) -> str: ...
    @property
    def arrival_s(self) -> float: ...


T = TypeVar("T", bound=Arriving)


@runtime_checkable
class ArrivalProcess(Protocol[T]):
    """What an engine consumes (see the module docstring)."""

    def release(self, clock_s: float) -> list[T]:
        """The requests arrived by ``clock_s`` and not released before, in arrival order, each
        stamped with its arrival time (never later than ``clock_s``)."""
        ...

    def next_arrival_s(self) -> float | None:
        """When the next unreleased request arrives, if that is known now; ``None`` when
        nothing is left or everything left waits for a request still in flight."""
        ...

    def complete(self, request_id: str, clock_s: float) -> None:
        """The engine finished (or refused) a released request at ``clock_s``."""
        ...

    def waiting(self) -> int:
        """Requests not released yet (an engine with nothing in flight and nothing arriving
        while this is positive has lost a completion)."""
        ...


class OpenLoop(Generic[T]):
    """Requests at their own ``arrival_s`` (non-decreasing), read lazily from ``requests``."""

    def __init__(self, requests: Iterable[T]) -> None:
        self._requests = iter(requests)
        self._next: T | None = next(self._requests, None)

    def release(self, clock_s: float) -> list[T]:
        released = []
        while self._next is not None and self._next.arrival_s <= clock_s:
            released.append(self._next)
            self._next = next(self._requests, None)
        return released

    def next_arrival_s(self) -> float | None:
        return None if self._next is None else self._next.arrival_s

    def complete(self, request_id: str, clock_s: float) -> None:
        return None

    def waiting(self) -> int:
        return 0 if self._next is None else 1  # at least one; the rest are not read yet


@dataclass(frozen=True)
class Step:
    """One request of a session."""

    request_id: str
    after: tuple[int, ...]
    """Indices of earlier steps of the session this one waits for; empty: the session's start."""
    delay_s: float
    """Arrives this long after the last of ``after`` finished (or after the session started)."""


@dataclass(frozen=True)
class Session:
    """What one user replays in one go (a conversation with its sub-agents)."""

    name: str
    steps: tuple[Step, ...]

    def __post_init__(self) -> None:
        for index, step in enumerate(self.steps):
            if any(not 0 <= before < index for before in step.after) or step.delay_s < 0:
                raise ValueError(f"session {self.name}: step {index} waits on a later step")


class ClosedLoop(Generic[T]):
    """``users`` users replaying ``sessions`` in order (see the module docstring).

    ``items`` maps request ids to what :meth:`release` hands out; a step whose request is not
    among them (the engine could never serve it) takes no time: it finishes as it arrives.
    """

    def __init__(self, sessions: Sequence[Session], users: int, items: Mapping[str, T]) -> None:
        if users < 1:
            raise ValueError(f"users must be >= 1, got {users}")
        self._sessions = sessions
        self._items = items
        self._queue = deque(range(len(sessions)))
        self._due: list[tuple[float, int, int, int]] = []  # (time, order, session, step)
        self._order = itertools.count()
        self._in_flight: dict[str, tuple[int, int]] = {}
        self._next: list[list[list[int]]] = [_successors(s) for s in sessions]
        self._left: dict[int, list[int]] = {}  # per open session: unfinished predecessors
        self._ready_s: dict[int, list[float]] = {}  # per open session: latest finish so far
        self._unfinished: dict[int, int] = {}
        self._waiting = sum(len(s.steps) for s in sessions)
        for _ in range(min(users, len(sessions))):
            self._start_next(0.0)

    def release(self, clock_s: float) -> list[T]:
        released = []
        while self._due and self._due[0][0] <= clock_s:
            time_s, _, session, index = heapq.heappop(self._due)
            self._waiting -= 1
            request_id = self._sessions[session].steps[index].request_id
            item = self._items.get(request_id)
            if item is None:
                self._finish(session, index, time_s)
                continue
            self._in_flight[request_id] = (session, index)
            released.append(dataclasses.replace(item, arrival_s=time_s))  # type: ignore[type-var]
        return released

    def next_arrival_s(self) -> float | None:
        return self._due[0][0] if self._due else None

    def complete(self, request_id: str, clock_s: float) -> None:
        session, index = self._in_flight.pop(request_id)
        self._finish(session, index, clock_s)

    def waiting(self) -> int:
        return self._waiting

    def _start_next(self, clock_s: float) -> None:
        while self._queue:
            session = self._queue.popleft()
            steps = self._sessions[session].steps
            if not steps:
                continue
            self._left[session] = [len(step.after) for step in steps]
            self._ready_s[session] = [clock_s] * len(steps)
            self._unfinished[session] = len(steps)
            for index, step in enumerate(steps):
                if not step.after:
                    self._push(clock_s + step.delay_s, session, index)
            return

    def _finish(self, session: int, index: int, clock_s: float) -> None:
        steps = self._sessions[session].steps
        left, ready = self._left[session], self._ready_s[session]
        for later in self._next[session][index]:
            left[later] -= 1
            ready[later] = max(ready[later], clock_s)
            if left[later] == 0:
                self._push(ready[later] + steps[later].delay_s, session, later)
        self._unfinished[session] -= 1
        if self._unfinished[session] == 0:
            del self._left[session], self._ready_s[session], self._unfinished[session]
            self._start_next(clock_s)  # the user takes the next session

    def _push(self, time_s: float, session: int, index: int) -> None:
        heapq.heappush(self._due, (time_s, next(self._order), session, index))


def _successors(session: Session) -> list[list[int]]:
    following: list[list[int]] = [[] for _ in session.steps]
    for index, step in enumerate(session.steps):
        for before in step.after:
            following[before].append(index)
    return following


def instant_order(process: ArrivalProcess[T]) -> Iterator[T]:
    """The requests of ``process`` as an engine that serves each instantly sees them: each
    finishes at its arrival (think times alone set the pace). The oracle's order."""
    while (clock_s := process.next_arrival_s()) is not None:
        for item in process.release(clock_s):
            yield item
            process.complete(item.request_id, item.arrival_s)
