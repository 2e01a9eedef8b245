"""Routing the serve engine's requests among several vLLM OpenAI servers.

:class:`ServeRouting` puts the same routers in front of real servers: before each decision it
takes the KV events that have arrived from the servers' ZeroMQ publishers (one topic per
server, :class:`~testbed.fleet.kv_events.ZmqEventStream`), hashes the prompt as the servers
do (:class:`~testbed.fleet.kv_events.PromptHasher`), and has the
:class:`~testbed.fleet.dispatch.Dispatcher` decide and record. What each server's prefix cache
held, in the record, is what its events said (the servers share one cache server, so their
connectors' events about it update one entry). The HTTP clients report first tokens and
finishes for the load book.
"""

from __future__ import annotations

from testbed.fleet.dispatch import Dispatcher
from testbed.fleet.kv_events import PromptHasher, ZmqEventStream, apply_events
from testbed.fleet.routers import Router, RouteRequest
from testbed.workloads import WorkloadRequest


class ServeRouting:
    """Decisions of ``router`` over ``num_instances`` servers; ``events`` receives their KV
    events (``None``: they publish none, and the record says nothing of their caches)."""

    def __init__(
        self,
        router: Router,
        num_instances: int,
        block_size: int,
        engine_blocks: int,
        events: ZmqEventStream | None,
    ) -> None:
        if events is None and router.needs_events():
            raise ValueError(f"the {router.name} router needs the servers' KV events")
        self.dispatcher = Dispatcher(router, [0] * num_instances, block_size, engine_blocks)
        if events is not None and self.dispatcher.kv is None:  # the record still needs them
            from testbed.fleet.kv_index import KVEventIndex

            self.dispatcher.kv = KVEventIndex([0] * num_instances)
        self.events = events
        self._hasher = PromptHasher(block_size)

    def place(self, request: WorkloadRequest, span: object, now_s: float) -> int:
        kv = self.dispatcher.kv
        if self.events is not None and kv is not None:
            for topic, events in self.events.poll():
                apply_events(kv, int(topic), events)
        hashes = self._hasher(request.prompt_token_ids.tolist())
        cached = kv.prefix(hashes).engine if kv is not None else None
        routed = RouteRequest(
            request.request_id, request.group, len(request.prompt_token_ids), hashes
        )
        return self.dispatcher.dispatch(routed, cached, span, now_s)

    def first_token(self, request_id: str) -> None:
        self.dispatcher.load.first_token(request_id)

    def finished(self, request_id: str) -> None:
        self.dispatcher.load.finished(request_id)
