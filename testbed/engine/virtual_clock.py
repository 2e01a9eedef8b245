"""Driving replay instances on one virtual clock: the replay engine (one instance) and the fleet.

Three kinds of event, taken in time order (ties: step ends, then arrivals, then step starts;
among instances, the lower index first), so a run is deterministic and every cache server
sees the instances' operations in the same order on every run:

- an **arrival**: the arrival process releases the requests due by now; each is placed on an
  instance (:class:`Placement`: the fleet's router, or the one instance) and handed to its
  scheduler;
- a **step start**: an instance with requests and no step in progress runs one scheduler step
  now (:meth:`~testbed.engine.instance.ReplayInstance.step`); it lasts what the time model
  projects;
- a **step end**: the step's outputs are stamped with the step's end (first tokens,
  finishes), finished requests are reported to the arrival process (a closed-loop user's
  next request is released its think time after that), and the instance may step again.

A request arriving while its instance is mid-step waits for the next step, as vLLM's engine
core picks up new requests between steps. Times are virtual: they do not depend on how fast
this machine runs the steps.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from testbed.core import telemetry
from testbed.core.closing import Closing
from testbed.engine.instance import ReplayInstance, StepReport
from testbed.engine.results import (
    EngineResult,
    OnFinish,
    RequestRecord,
    close_request,
    open_request,
)
from testbed.workloads import ArrivalProcess, OpenLoop, WorkloadRequest

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from testbed.engine.vllm_setup import RequestFactory

MAX_IDLE_STEPS = 100_000
_END, _ARRIVAL, _START = 0, 1, 2  # the order of events at the same time


class Placement:
    """Where arriving requests go. This base is the one-instance case (a plain replay):
    everything to instance 0, nothing recorded; the fleet's router subclasses it."""

    def place(
        self, request: WorkloadRequest, vllm_request: Request, span: Any, now_s: float
    ) -> int:
        """The instance for ``request`` (``span``: its ``kvcache.request`` span)."""
        return 0

    @contextmanager
    def scope(self, instance: int) -> Iterator[None]:
        """Around everything ``instance`` does in a step (its spans are its own)."""
        yield

    def stepped(self, instance: int) -> None:
        """``instance`` just ran a step (its scheduler published that step's events)."""

    def first_token(self, instance: int, request_id: str, now_s: float) -> None:
        """A request's first token came out of ``instance``."""

    def finished(self, instance: int, request_id: str, now_s: float) -> None:
        """A request finished on ``instance``."""


@dataclass
class _Lane:
    instance: ReplayInstance
    free_s: float = 0.0
    """When its step in progress ends, or since when it has been idle."""
    pending: StepReport | None = None
    idle_steps: int = 0


@dataclass
class _Open:
    record: RequestRecord
    span: Any
    lane: int


@dataclass
class VirtualClock:
    """Runs ``instances`` (see the module docstring). ``at_once``: every request arrives at
    the start (the spec's ``arrival = "all"``)."""

    instances: Sequence[ReplayInstance]
    requests: RequestFactory
    placement: Placement = field(default_factory=Placement)
    at_once: bool = False

    def __post_init__(self) -> None:
        self._lanes = [_Lane(instance) for instance in self.instances]
        self._open: dict[str, _Open] = {}
        self._now = 0.0

    def run(
        self,
        arrivals: ArrivalProcess[WorkloadRequest],
        result: EngineResult,
        on_finish: OnFinish | None = None,
    ) -> EngineResult:
        started = time.perf_counter()
        while (event := self._next_event(arrivals)) is not None:
            self._now, kind, lane = event
            if kind == _END:
                self._end(lane, arrivals, result, on_finish)
            elif kind == _ARRIVAL:
                due = float("inf") if self.at_once else self._now
                for request in arrivals.release(due):
                    self._arrive(request, arrivals, result)
            else:
                self._start(lane, result)
        if arrivals.waiting():
            raise RuntimeError(
                f"{arrivals.waiting()} requests wait for completions the engine never reported"
            )
        result.wall_s = time.perf_counter() - started
        result.virtual_s = self._now
        return result

    def _next_event(
        self, arrivals: ArrivalProcess[WorkloadRequest]
    ) -> tuple[float, int, int] | None:
        candidates = []
        for index, lane in enumerate(self._lanes):
            if lane.pending is not None:
                candidates.append((lane.free_s, _END, index))
            elif lane.instance.has_requests():
                candidates.append((max(lane.free_s, self._now), _START, index))
        upcoming = arrivals.next_arrival_s()
        if upcoming is not None:
            candidates.append((self._now if self.at_once else upcoming, _ARRIVAL, -1))
        return min(candidates) if candidates else None

    def _arrive(
        self,
        request: WorkloadRequest,
        arrivals: ArrivalProcess[WorkloadRequest],
        result: EngineResult,
    ) -> None:
        if not self._lanes[0].instance.fits(request):  # every instance has the same limits
            result.rejected.append(request.request_id)
            arrivals.complete(request.request_id, self._now)
            return
        record, span = open_request(request, self._now if self.at_once else request.arrival_s)
        vllm_request = self.requests.for_workload(request, telemetry.traceparent_of(span))
        index = self.placement.place(request, vllm_request, span, self._now)
        lane = self._lanes[index]
        if lane.pending is None and not lane.instance.has_requests():
            lane.free_s = max(lane.free_s, self._now)
        with self.placement.scope(index):
            lane.instance.add(request, vllm_request)
        self._open[request.request_id] = _Open(record, span, index)

    def _start(self, index: int, result: EngineResult) -> None:
        lane = self._lanes[index]
        with self.placement.scope(index):
            report = lane.instance.step()
        self.placement.stepped(index)
        lane.pending = report
        lane.free_s = self._now + report.duration_s
        result.steps += 1
        result.integrity_errors += report.integrity_errors
        result.max_step_s = max(result.max_step_s, report.wall_s)
        for request_id in report.first_scheduled:
            record = self._open[request_id].record
            if record.scheduled_s is None:
                record.scheduled_s = self._now
        lane.idle_steps = 0 if report.scheduled_tokens else lane.idle_steps + 1
        if lane.idle_steps > MAX_IDLE_STEPS:
            raise RuntimeError(
                f"instance {index} made no progress for {lane.idle_steps} steps with "
                f"{len(lane.instance.scheduler.requests)} requests left; is a load never "
                "finishing?"
            )

    def _end(
        self,
        index: int,
        arrivals: ArrivalProcess[WorkloadRequest],
        result: EngineResult,
        on_finish: OnFinish | None,
    ) -> None:
        lane = self._lanes[index]
        report, lane.pending = lane.pending, None
        assert report is not None
        for request_id, tokens in report.new_tokens.items():
            record = self._open[request_id].record
            if tokens and record.first_token_s is None:
                record.first_token_s = self._now
                self.placement.first_token(index, request_id, self._now)
            record.output_tokens += len(tokens)
        for request_id in report.finished:
            entry = self._open.pop(request_id)
            entry.record.finish_s = self._now
            close_request(entry.record, entry.span)
            result.records.append(entry.record)
            arrivals.complete(request_id, self._now)
            self.placement.finished(index, request_id, self._now)
            if on_finish is not None:
                on_finish(entry.record)


def drive(
    engine: str,
    instances: Sequence[ReplayInstance],
    requests: RequestFactory,
    workload: Iterable[WorkloadRequest] | ArrivalProcess[WorkloadRequest],
    on_finish: OnFinish | None = None,
    placement: Placement | None = None,
) -> EngineResult:
    """Runs ``workload`` (requests in arrival order, or an arrival process: closed-loop users
    told, on the virtual clock, when each request finished) on ``instances``; the result is
    named ``engine``."""
    spec = instances[0].spec.run
    result = EngineResult(engine=engine, metadata_only=spec.metadata_only)
    arrivals = workload if isinstance(workload, ArrivalProcess) else OpenLoop(workload)
    clock = VirtualClock(
        instances, requests, placement or Placement(), at_once=spec.arrival == "all"
    )
    return clock.run(arrivals, result, on_finish)


class ClockedEngine(Closing):
    """An engine of replay instances on one virtual clock (the replay engine: one; the fleet:
    several behind a router, its ``placement``). Context manager."""

    name: ClassVar[str]
    """What its results are called (``EngineResult.engine``)."""
    instances: list[ReplayInstance]
    requests: RequestFactory
    placement: Placement | None = None

    def run(
        self,
        workload: Iterable[WorkloadRequest] | ArrivalProcess[WorkloadRequest],
        on_finish: OnFinish | None = None,
    ) -> EngineResult:
        """Runs ``workload``: requests in arrival order, or an arrival process (closed-loop
        users) that is told, on the virtual clock, when each request finished (:func:`drive`)."""
        return drive(self.name, self.instances, self.requests, workload, on_finish, self.placement)
