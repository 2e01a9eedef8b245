"""One routing decision in a fleet of replay instances, and its record.

:class:`FleetPlacement` is the virtual clock's :class:`~testbed.engine.virtual_clock.Placement`
for a fleet: at each arrival it shows the router the fleet (its load book; the KV event index,
fed after every step from each instance's scheduler; what each prefix cache really holds),
sends the request where the router says, and records the decision in a ``kvcache.route`` span
under the request's ``kvcache.request`` span (which gets ``kvcache.instance``):

- ``kvcache.route.router``, ``kvcache.instance`` (the choice), ``kvcache.route.clock_s``;
- ``kvcache.route.costs``: the router's cost per instance (routers that weigh instances);
- ``kvcache.route.cached_tokens``: per instance, the request's prefix its prefix cache held at
  the decision (whole blocks, read from vLLM's block pool): what the analysis needs for the
  ``routing`` miss cause (METRICS.md), and where a prefix was when it was lost;
- ``kvcache.route.load_tokens``: per instance, the router's queued and running tokens.

Spans started while an instance works (:meth:`scope`) carry that instance.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from testbed import telemetry
from testbed.engine.instance import ReplayInstance
from testbed.engine.virtual_clock import Placement
from testbed.fleet.kv_events import apply_events, event_block_hashes
from testbed.fleet.kv_index import KVEventIndex
from testbed.fleet.load import LoadBook
from testbed.fleet.routers import FleetView, Router, RouteRequest
from testbed.telemetry import attributes as a
from testbed.workloads import WorkloadRequest


class FleetPlacement(Placement):
    """Routes arrivals among ``instances``; ``server_of[i]`` is the cache server instance
    ``i`` uses (its KV events about the external cache update that server's index)."""

    def __init__(
        self, instances: Sequence[ReplayInstance], router: Router, server_of: Sequence[int]
    ) -> None:
        self.instances = instances
        self.router = router
        self.load = LoadBook(len(instances))
        self.kv = KVEventIndex(server_of) if router.needs_kv_events else None
        spec = instances[0].spec
        self._block_size = spec.block_size
        self._engine_blocks = spec.engine_blocks

    def place(self, request: WorkloadRequest, vllm_request: Any, span: Any, now_s: float) -> int:
        hashes = vllm_request.block_hashes
        cached = [instance.cached_prefix_blocks(hashes) for instance in self.instances]
        routed = RouteRequest(
            request.request_id,
            request.group,
            len(request.prompt_token_ids),
            event_block_hashes(hashes) if self.kv is not None else hashes,
        )
        view = FleetView(
            len(self.instances), self._block_size, self._engine_blocks, self.load, self.kv, cached
        )
        load = self.load.load_tokens()
        choice = self.router.choose(routed, view)
        self.router.routed(routed, choice.instance, view)
        self.load.dispatched(request.request_id, choice.instance, routed.prompt_tokens)
        span.set_attribute(a.INSTANCE, choice.instance)
        attributes: dict[str, Any] = {
            a.REQUEST_ID: request.request_id,
            a.ROUTER: self.router.name,
            a.INSTANCE: choice.instance,
            a.ROUTE_CLOCK_S: now_s,
            a.ROUTE_CACHED_TOKENS: [blocks * self._block_size for blocks in cached],
            a.ROUTE_LOAD_TOKENS: load,
        }
        if choice.costs:
            attributes[a.ROUTE_COSTS] = list(choice.costs)
        telemetry.start_span(
            a.ROUTE, parent=telemetry.traceparent_of(span), attributes=attributes
        ).end()
        return choice.instance

    @contextmanager
    def scope(self, instance: int) -> Iterator[None]:
        with telemetry.instance_scope(instance):
            yield

    def stepped(self, instance: int) -> None:
        events = self.instances[instance].take_kv_events()
        if self.kv is not None:
            apply_events(self.kv, instance, events)

    def first_token(self, instance: int, request_id: str, now_s: float) -> None:
        self.load.first_token(request_id)

    def finished(self, instance: int, request_id: str, now_s: float) -> None:
        self.load.finished(request_id)
