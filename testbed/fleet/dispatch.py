"""One routing decision, whoever runs the instances, and its record.

:class:`Dispatcher` holds what a router may look at (its load book, the KV event index) and
turns a request into a decision: the router chooses, remembers, the book is told, and the
decision is recorded in a ``kvcache.route`` span under the request's ``kvcache.request`` span
(which gets ``kvcache.instance``):

- ``kvcache.route.router``, ``kvcache.instance`` (the choice), ``kvcache.route.clock_s`` (the
  engine's clock at the decision);
- ``kvcache.route.costs``: the router's cost per instance (routers that weigh instances);
- ``kvcache.route.cached_tokens``: per instance, the request's prefix its prefix cache held at
  the decision (whole blocks): what the ``routing`` miss cause needs (METRICS.md), and where
  a prefix was when it was lost. A fleet of replay instances reads it from vLLM's block pools;
  a fleet of vLLM servers from their KV events; without either it is left out;
- ``kvcache.route.load_tokens``: per instance, the router's queued and running tokens.

The replay fleet (:mod:`.placement`) and the serve engine (:mod:`.serve_routing`) both use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from testbed.core import telemetry
from testbed.core.telemetry import attributes as a
from testbed.fleet.kv_index import KVEventIndex
from testbed.fleet.load import LoadBook
from testbed.fleet.routers import FleetView, Router, RouteRequest


class Dispatcher:
    """Decisions of ``router`` over ``num_instances`` instances; ``server_of[i]`` is the cache
    server instance ``i`` uses (for the KV event index, kept when the router needs it)."""

    def __init__(
        self, router: Router, server_of: Sequence[int], block_size: int, engine_blocks: int
    ) -> None:
        self.router = router
        self.num_instances = len(server_of)
        self.load = LoadBook(self.num_instances)
        self.kv = KVEventIndex(server_of) if router.needs_kv_events else None
        self.block_size = block_size
        self.engine_blocks = engine_blocks

    def dispatch(
        self, request: RouteRequest, cached_blocks: Sequence[int] | None, span: Any, now_s: float
    ) -> int:
        """The instance for ``request`` (recorded; the load book counts it there).
        ``cached_blocks``: per instance, the request's leading blocks its prefix cache holds
        (``None``: unknown)."""
        view = FleetView(
            self.num_instances,
            self.block_size,
            self.engine_blocks,
            self.load,
            self.kv,
            cached_blocks or (),
        )
        load = self.load.load_tokens()
        choice = self.router.choose(request, view)
        self.router.routed(request, choice.instance, view)
        self.load.dispatched(request.request_id, choice.instance, request.prompt_tokens)
        span.set_attribute(a.INSTANCE, choice.instance)
        attributes: dict[str, Any] = {
            a.REQUEST_ID: request.request_id,
            a.ROUTER: self.router.name,
            a.INSTANCE: choice.instance,
            a.ROUTE_CLOCK_S: now_s,
            a.ROUTE_LOAD_TOKENS: load,
        }
        if cached_blocks is not None:
            attributes[a.ROUTE_CACHED_TOKENS] = [b * self.block_size for b in cached_blocks]
        if choice.costs:
            attributes[a.ROUTE_COSTS] = list(choice.costs)
        parent = telemetry.traceparent_of(span)
        telemetry.start_span(a.ROUTE, parent=parent, attributes=attributes).end()
        return choice.instance
