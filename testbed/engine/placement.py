"""Routing the arrivals of a fleet of replay instances on the virtual clock.

:class:`FleetPlacement` is the :class:`~testbed.engine.virtual_clock.Placement` of the fleet
engine: at each arrival it reads, from vLLM's block pool of every instance, how much of the
request each prefix cache holds (the truth the ``routing`` miss cause is counted against, and
what the ``oracle`` router sees) and has the :class:`~testbed.fleet.dispatch.Dispatcher`
decide and record. After every step it feeds the KV events the instance's scheduler published
into the dispatcher's index (``kv_precise``); while an instance works (:meth:`scope`), the
spans started carry its number.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from testbed.core import telemetry
from testbed.engine.instance import ReplayInstance
from testbed.engine.virtual_clock import Placement
from testbed.fleet.dispatch import Dispatcher
from testbed.fleet.kv_events import apply_events, event_block_hashes
from testbed.fleet.routers import Router, RouteRequest
from testbed.workloads import WorkloadRequest


class FleetPlacement(Placement):
    """Routes arrivals among ``instances``; ``server_of[i]`` is the cache server instance
    ``i`` uses (its KV events about the external cache update that server's index)."""

    def __init__(
        self, instances: Sequence[ReplayInstance], router: Router, server_of: Sequence[int]
    ) -> None:
        self.instances = instances
        spec = instances[0].spec
        self.dispatcher = Dispatcher(router, server_of, spec.run.block_size, spec.engine_blocks)

    @property
    def kv(self) -> Any:
        return self.dispatcher.kv

    def place(self, request: WorkloadRequest, vllm_request: Any, span: Any, now_s: float) -> int:
        hashes = vllm_request.block_hashes
        cached = [instance.cached_prefix_blocks(hashes) for instance in self.instances]
        routed = RouteRequest(
            request.request_id,
            request.group,
            len(request.prompt_token_ids),
            event_block_hashes(hashes) if self.kv is not None else hashes,
        )
        return self.dispatcher.dispatch(routed, cached, span, now_s)

    @contextmanager
    def scope(self, instance: int) -> Iterator[None]:
        with telemetry.instance_scope(instance):
            yield

    def stepped(self, instance: int) -> None:
        events = self.instances[instance].take_kv_events()
        if self.kv is not None:
            apply_events(self.kv, instance, events)

    def first_token(self, instance: int, request_id: str, now_s: float) -> None:
        self.dispatcher.load.first_token(request_id)

    def finished(self, instance: int, request_id: str, now_s: float) -> None:
        self.dispatcher.load.finished(request_id)
