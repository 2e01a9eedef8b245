"""Peer-to-peer between the cache servers of one fleet: a lookup that misses here asks the peers.

Runs in the cache server process. A fleet with a server per instance and ``p2p`` on tells each
server the others (:class:`~testbed.core.protocol.SetPeers`, an administration request; the
run sends it once every server is up). From then on a lookup whose local hit stops short of
the request's chunks, at a chunk nobody is storing here (``absent``), does
:meth:`Peering.fill` before it locks its hit:

1. **Which peer holds what: asked, not remembered.** A :class:`~testbed.core.protocol.PeerProbe`
   goes to every live peer at once, naming the chunks after the local hit; each answers how
   many leading ones it holds (a read of its index: no lock, no change). There is no directory,
   so nothing is ever stale: the cost is one round trip to each peer per lookup that misses
   here (the probes go together, so the wait is the slowest peer's), paid also when no peer
   holds anything. A chunk a peer evicts between its answer and the fetch is simply not sent:
   the fetch brings fewer chunks (counted as ``short_chunks``).
2. **The copy.** The peer holding the longest run (the lowest-numbered among equals) is sent a
   :class:`~testbed.core.protocol.PeerFetch` for that run; it answers the objects' bytes (and a
   blake3 digest of each), which count as a hit of those chunks there. Each chunk is reserved
   in this server's L1 (evicting by its policy, as a store would), its bytes written into the
   pool after their digest verified, and committed; the lookup then finds it as an L1 hit and
   locks it with the rest, so the worker loads it as any other L1 hit. The copy is one span,
   ``kvcache.server.peer_fetch``, a child of the lookup's (the request's trace): the peer (its
   name, a fleet's ``instance N``), the chunks and bytes it brought, the wait.
3. **Faults.** A peer that does not answer within :data:`PEER_TIMEOUT_S` (killed, stuck) is a
   probe or fetch that failed (counted); the RPC client marks it down for every later lookup
   until a heartbeat is answered again, so a dead peer costs one timeout, not one per lookup.
   Bytes whose digest does not verify, a chunk that does not fit, a chunk being stored here
   meanwhile: the fill stops at that chunk, nothing of it is committed. Every outcome is a
   count in :class:`~testbed.core.protocol.PeerStats` (``GetStats``) and an attribute of the
   span; never an error of the lookup.

The handlers run on the server's loop like every other: :meth:`Peering.fill` yields while it
waits for the peers, so this server keeps answering (its peers' probes and fetches included)
in the meantime, and two servers asking each other at once cannot deadlock.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from typing import TypeVar

import blake3
import numpy as np

from server.context import Call, Shared
from server.objects import CacheObject, Eviction, Space
from server.tiers.base import HitSource
from testbed.core import protocol as p
from testbed.core import telemetry
from testbed.core.keys import ChunkHash
from testbed.core.rpc import RpcClient, RpcFuture, ServerUnavailable
from testbed.core.telemetry import attributes as a

PEER_TIMEOUT_S = 1.0
"""How long a probe or a fetch waits for a peer before it counts as failed."""
MAX_FETCH_BYTES = 64 << 20
"""Bytes one fetch may bring (a longer run is cut: the rest is computed)."""
Asked = TypeVar("Asked", bound=p.PeerProbe)
P2P_SOURCE: HitSource = "p2p"
"""The hit source of a chunk a peer's copy brought (vLLM's name)."""
PEER_STORER = "peer"
"""The storer named on objects a peer's copy wrote (their store was the peer's)."""


class Peering:
    """The peers of this server and the handlers of the peer requests (module docstring)."""

    def __init__(self, shared: Shared) -> None:
        self.s = shared
        self.stats = p.PeerStats()
        self.peers: list[p.PeerEndpoint] = []
        self._clients: list[RpcClient] = []

    def close(self) -> None:
        for client in self._clients:
            client.close()
        self._clients = []

    # -- handlers ------------------------------------------------------------------------------

    def set_peers(self, call: Call, req: p.SetPeers) -> p.Reply:
        self.close()
        self.peers = list(req.peers)
        self._clients = [
            RpcClient(peer.url, role="peer", token=peer.token, timeout_s=PEER_TIMEOUT_S)
            for peer in self.peers
        ]
        call.span.set_attribute(a.PEERS, [peer.url for peer in self.peers])
        return p.Ack()

    def probe(self, call: Call, req: p.PeerProbe) -> p.Reply:
        self.stats.served_probes += 1
        return p.PeerHeld(held_chunks=len(self._held(req)))

    def fetch(self, call: Call, req: p.PeerFetch) -> p.Reply:
        """The leading held chunks' objects, within ``max_bytes``; each a hit here."""
        reply = p.PeerChunks()
        array = None if self.s.pool is None else self.s.pool.array
        total = 0
        for objects in self._held(req):
            size = sum(obj.nbytes for obj in objects)
            if reply.num_chunks and total + size > req.max_bytes:
                break
            for obj in objects:
                self.s.cache.touch_object(obj, hit=True)
                reply.nbytes.append(obj.nbytes)
                if array is not None and obj.offset is not None:
                    data = array[obj.offset : obj.offset + obj.nbytes].tobytes()
                    reply.data.append(data)
                    reply.digests.append(blake3.blake3(data).digest())
            reply.num_chunks += 1
            total += size
        self.stats.served_chunks += reply.num_chunks
        self.stats.served_bytes += total
        call.span.set_attributes({a.CHUNKS: reply.num_chunks, a.BYTES: total})
        return reply

    # -- the lookup's step ---------------------------------------------------------------------

    def fill(self, call: Call, req: p.Lookup, local_hit: int) -> Generator[None, None, int]:
        """Brings the chunks after ``local_hit`` that a peer holds into L1; returns how many
        (module docstring). Yields while it waits; never raises for a peer's fault."""
        rest = req.chunk_hashes[local_hit:]
        live = [(i, c) for i, c in enumerate(self._clients) if c.alive]
        if not rest or not self._clients:
            return 0
        self.stats.lookups += 1
        started = time.monotonic()
        span = telemetry.start_span(
            a.SERVER_PEER_FETCH,
            parent=call.traceparent,
            attributes={a.CHUNKS_REQUESTED: len(rest), a.PEERS: len(self._clients)},
        )
        try:
            held = yield from self._probe_all(call, req, rest, live)
            best = max(range(len(held)), key=lambda k: (held[k][1], -held[k][0]), default=None)
            if best is None or held[best][1] == 0:
                span.set_attributes({a.CHUNKS: 0, a.BYTES: 0})
                return 0
            index, count = held[best]
            chunks = yield from self._fetch(call, req, rest[:count], index, span)
            self.stats.short_chunks += count - chunks
            self.stats.peer_hits += chunks > 0
            return chunks
        finally:
            span.set_attribute(a.PEER_WAIT_MS, (time.monotonic() - started) * 1e3)
            span.end()

    def _probe_all(
        self,
        call: Call,
        req: p.Lookup,
        rest: Sequence[ChunkHash],
        live: list[tuple[int, RpcClient]],
    ) -> Generator[None, None, list[tuple[int, int]]]:
        """``(peer index, chunks held)`` of every live peer that answered."""
        probe = _probe(req, rest, p.PeerProbe, call.traceparent)
        probes = [(index, client.submit(probe)) for index, client in live]
        self.stats.probe_failures += len(self._clients) - len(live)
        yield from _wait([future for _, future in probes])
        held = []
        for index, future in probes:
            reply = _reply(future)
            if isinstance(reply, p.PeerHeld):
                held.append((index, reply.held_chunks))
            else:
                self.stats.probe_failures += 1
        return held

    def _fetch(
        self,
        call: Call,
        req: p.Lookup,
        hashes: Sequence[ChunkHash],
        index: int,
        span: telemetry.Span,
    ) -> Generator[None, None, int]:
        request = _probe(req, hashes, p.PeerFetch, call.traceparent)
        request.max_bytes = MAX_FETCH_BYTES
        future = self._clients[index].submit(request)
        yield from _wait([future])
        reply = _reply(future)
        peer = self.peers[index]
        span.set_attributes({a.PEER: peer.name or peer.url, a.SERVER_URL: peer.url})
        if not isinstance(reply, p.PeerChunks):
            self.stats.fetch_failures += 1
            span.set_attributes({a.CHUNKS: 0, a.BYTES: 0, a.PEER_OUTCOME: "failed"})
            return 0
        space = Space(req.model, req.world_size, req.cache_salt)
        chunks, nbytes = self._place(call, space, hashes, reply)
        self.stats.chunks += chunks
        self.stats.bytes += nbytes
        span.set_attributes({a.CHUNKS: chunks, a.BYTES: nbytes, a.PEER_OUTCOME: "copied"})
        return chunks

    def _place(
        self, call: Call, space: Space, hashes: Sequence[ChunkHash], reply: p.PeerChunks
    ) -> tuple[int, int]:
        """Commits the fetched chunks in order into L1 until one cannot be; (chunks, bytes)."""
        eviction = Eviction(reason="capacity")
        world = space.world_size
        placed = placed_bytes = 0
        try:
            for j, chunk_hash in enumerate(hashes[: reply.num_chunks]):
                objects = self._reserve(call, space, chunk_hash, reply, j * world, eviction)
                if objects is None:
                    break
                for obj in objects:
                    self.s.cache.commit(obj)
                placed += 1
                placed_bytes += sum(obj.nbytes for obj in objects)
        finally:
            self.s.record_eviction(eviction, call.traceparent)
        return placed, placed_bytes

    def _reserve(
        self,
        call: Call,
        space: Space,
        chunk_hash: ChunkHash,
        reply: p.PeerChunks,
        first: int,
        eviction: Eviction,
    ) -> list[CacheObject] | None:
        """One chunk's objects reserved and written (not committed), or ``None`` (nothing of
        it left reserved) when it is here already, does not fit or does not verify."""
        cache, array = self.s.cache, None if self.s.pool is None else self.s.pool.array
        keys = space.keys(chunk_hash)
        if first + len(keys) > len(reply.nbytes) or any(cache.get(k) is not None for k in keys):
            return None
        if array is not None and len(reply.data) < first + len(keys):
            return None  # the peer holds no bytes (metadata only): nothing to load here
        objects: list[CacheObject] = []
        for rank, key in enumerate(keys):
            slot = first + rank
            obj = cache.reserve(key, reply.nbytes[slot], call.traceparent, PEER_STORER, eviction)
            if obj is not None:
                objects.append(obj)
            if obj is None or not self._write(obj, reply, slot, array):
                for reserved in objects:
                    cache.remove(reserved)
                return None
        return objects

    def _write(self, obj: CacheObject, reply: p.PeerChunks, slot: int, array: object) -> bool:
        if not isinstance(array, np.ndarray) or obj.offset is None:
            return True
        data = reply.data[slot]
        if len(data) != obj.nbytes or blake3.blake3(data).digest() != reply.digests[slot]:
            self.stats.corrupt_objects += 1
            return False
        array[obj.offset : obj.offset + obj.nbytes] = np.frombuffer(data, dtype=np.uint8)
        return True

    def _held(self, req: p.PeerProbe) -> list[list[CacheObject]]:
        """The objects of the leading chunks committed here on every rank."""
        space = Space(req.model, req.world_size, req.cache_salt)
        held: list[list[CacheObject]] = []
        for chunk_hash in req.chunk_hashes:
            objects = [self.s.cache.committed(key) for key in space.keys(chunk_hash)]
            present = [obj for obj in objects if obj is not None]
            if len(present) < len(objects):
                break
            held.append(present)
        return held


def _probe(req: p.Lookup, hashes: Sequence[ChunkHash], kind: type[Asked], parent: str) -> Asked:
    return kind(
        model=req.model,
        world_size=req.world_size,
        cache_salt=req.cache_salt,
        chunk_hashes=list(hashes),
        traceparent=parent,
    )


def _wait(futures: list[RpcFuture]) -> Generator[None, None, None]:
    """Yields until every future is done (each fails by its own timeout)."""
    while not all(future.done() for future in futures):
        yield


def _reply(future: RpcFuture) -> p.Reply | None:
    try:
        return future.result(0)
    except (ServerUnavailable, TimeoutError):
        return None
