"""vLLM's KV events into the fleet's index: the one fleet module that imports vLLM.

- :class:`InProcessPublisher`: the publisher of a replay instance's scheduler. vLLM's
  ``Scheduler`` publishes each step's events (its prefix cache's, then its connector's
  ``take_events()``) through ``self.kv_event_publisher`` at the end of ``update_from_output``;
  this one keeps them for the fleet to drain after the step. vLLM's ZeroMQ publisher would
  deliver them from a thread, after an unknown delay: the virtual clock needs every event of a
  step before the next decision, and ``KVEventsConfig.publisher`` admits only ``null`` and
  ``zmq``, so the instance is built with ``null`` and this publisher installed in its place.
- :class:`ZmqEventStream`: the subscriber of vLLM servers' ZeroMQ publishers
  (``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'``): frames
  ``(topic, sequence, msgpack KVEventBatch)``, one topic per server.
- :func:`apply_events`: events into a :class:`~testbed.fleet.kv_index.KVEventIndex`, by type;
  :class:`PromptHasher`: a prompt's block hashes as a vLLM server names them in its events.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgspec
import zmq
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventPublisher,
    KVEventBatch,
)
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash, maybe_convert_block_hash

from testbed.core.closing import Closing
from testbed.fleet.kv_index import KVEventIndex


class InProcessPublisher(EventPublisher):
    """Keeps the batches a scheduler publishes until :meth:`drain` (see the module docstring)."""

    def __init__(self, data_parallel_rank: int = 0) -> None:
        super().__init__(data_parallel_rank)
        self._batches: deque[EventBatch] = deque()

    @classmethod
    def install(cls, scheduler: Any) -> InProcessPublisher:
        """Replaces ``scheduler``'s publisher (built with ``publisher="null"``) with one."""
        publisher = cls()
        scheduler.kv_event_publisher = publisher
        return publisher

    def publish(self, events: EventBatch) -> None:
        self._batches.append(events)

    def drain(self) -> list[Any]:
        """The events published since the last call, in order."""
        events = [event for batch in self._batches for event in batch.events]
        self._batches.clear()
        return events

    def shutdown(self) -> None:
        self._batches.clear()


def _stored(index: KVEventIndex, instance: int, event: BlockStored) -> None:
    index.stored(instance, event.medium, event.block_hashes)


def _removed(index: KVEventIndex, instance: int, event: BlockRemoved) -> None:
    index.removed(instance, event.medium, event.block_hashes)


def _cleared(index: KVEventIndex, instance: int, event: AllBlocksCleared) -> None:
    index.cleared(instance)


_APPLY: dict[type, Callable[[KVEventIndex, int, Any], None]] = {
    BlockStored: _stored,
    BlockRemoved: _removed,
    AllBlocksCleared: _cleared,
}


def apply_events(index: KVEventIndex, instance: int, events: Iterable[Any]) -> None:
    """Applies ``instance``'s events to ``index``; event types it does not know are skipped."""
    for event in events:
        apply = _APPLY.get(type(event))
        if apply is not None:
            apply(index, instance, event)


def event_block_hashes(block_hashes: Iterable[Any]) -> list[Any]:
    """A request's block hashes (``Request.block_hashes``) as vLLM's events name them."""
    return [maybe_convert_block_hash(block_hash) for block_hash in block_hashes]


class PromptHasher:
    """vLLM's block hashes of a prompt's full blocks, as a vLLM server with the default
    ``--prefix-caching-hash-algo sha256`` and this process's ``PYTHONHASHSEED`` (unset: vLLM's
    fixed seed) computes them, for a router in front of servers it does not run: a request
    without LoRA, multimodal inputs or ``cache_salt``."""

    def __init__(self, block_size: int, algorithm: str = "sha256") -> None:
        self.block_size = block_size
        self._hash = get_hash_fn_by_name(algorithm)
        init_none_hash(self._hash)

    def __call__(self, token_ids: Sequence[int]) -> list[Any]:
        hashes: list[Any] = []
        parent = None
        size = self.block_size
        for start in range(0, len(token_ids) - size + 1, size):
            parent = hash_block_tokens(self._hash, parent, token_ids[start : start + size])
            hashes.append(parent)
        return event_block_hashes(hashes)


class ZmqEventStream(Closing):
    """Receives the KV events of several vLLM servers on one socket. It binds ``bind`` (a
    loopback ``tcp://127.0.0.1:0`` by default; :attr:`endpoint` is the address bound) and each
    server's publisher connects to it, its batches under its own ``topic`` (vLLM's
    ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint":
    ENDPOINT, "topic": TOPIC}'``: an endpoint without ``*`` connects). Context manager;
    :meth:`poll` returns the events that have arrived, per topic, without waiting."""

    def __init__(self, bind: str = "tcp://127.0.0.1:0") -> None:
        self._context: Any = zmq.Context.instance()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.bind(bind)
        self.endpoint: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.last_sequence: dict[str, int] = {}
        """Per topic, the sequence number of the last batch received (gaps: batches lost)."""

    def poll(self) -> list[tuple[str, list[Any]]]:
        """``(topic, events)`` of every batch that has arrived, in arrival order."""
        batches = []
        while self._socket.poll(0):
            topic, sequence, payload = self._socket.recv_multipart()
            name = topic.decode()
            self.last_sequence[name] = int.from_bytes(sequence, "big", signed=True)
            batches.append((name, list(self._decoder.decode(payload).events)))
        return batches

    def close(self) -> None:
        self._socket.close()
