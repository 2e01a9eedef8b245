"""A cache client that speaks the protocol itself, without the connector: chaos probes.

Runs in the chaos process (and in the client it kills, ``testbed.chaos.holder``). One
:class:`ProbeClient` is one connection acting as both a scheduler (lookups, lock frees,
session ends) and a worker of one model (stores, retrieves), so a scenario can hold exactly
the locks, pins and reservations it wants, name its operations, and check every byte it
reads back: a store writes a pattern derived from each chunk's hash into its slots, a
retrieve compares what the slots hold with that pattern.
"""

from __future__ import annotations

import hashlib
import itertools
import mmap
import os

from testbed.core import protocol as p
from testbed.core.closing import Closing
from testbed.core.keys import HASH_BYTES, ChunkHash
from testbed.core.rpc import RpcClient

BYTES_PER_TOKEN = 128
"""The probes' KV layout: 128 bytes per token, 2 layers, blocks of 16 tokens."""


def pattern(chunk_hash: bytes, nbytes: int) -> bytes:
    """The bytes a probe stores for ``chunk_hash``: its BLAKE2b digest, repeated."""
    digest = hashlib.blake2b(chunk_hash).digest()
    return (digest * (nbytes // len(digest) + 1))[:nbytes]


def chunk_hashes(label: str, count: int) -> list[ChunkHash]:
    """``count`` distinct chunk hashes named by ``label`` (stable across processes)."""
    return [
        ChunkHash(hashlib.blake2b(f"{label}/{i}".encode(), digest_size=HASH_BYTES).digest())
        for i in range(count)
    ]


class ProbeClient(Closing):
    """One connection to a cache server; context manager. Raises ``RemoteError`` when the
    server refuses what a method asks (callers that expect a refusal use :attr:`rpc`)."""

    def __init__(
        self,
        url: str,
        token: str,
        *,
        model: str = "probe",
        timeout_s: float = 5.0,
        heartbeat_interval_s: float = 1.0,
        first_op_id: int = 1,
    ) -> None:
        self.rpc = RpcClient(
            url,
            role=f"probe-{model}",
            token=token,
            timeout_s=timeout_s,
            heartbeat_interval_s=heartbeat_interval_s,
        )
        self.model = model
        self.epoch = 0
        self.chunk_size = 0
        self._map: mmap.mmap | None = None
        self._op_ids = itertools.count(first_op_id)

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
        self.rpc.close()

    def new_op_id(self) -> int:
        return next(self._op_ids)

    # --- worker --------------------------------------------------------------------------------

    def register(self) -> p.WorkerRegistered:
        """Registers the probe layout and maps the pool (none in metadata-only mode)."""
        reply = self.rpc.call(
            p.RegisterWorker(
                model=self.model,
                world_size=1,
                kv_rank=0,
                layout=p.KVLayout(num_layers=2, block_size=16, bytes_per_token=BYTES_PER_TOKEN),
            )
        )
        assert isinstance(reply, p.WorkerRegistered)
        self.epoch, self.chunk_size = reply.epoch, reply.chunk_size
        if reply.pool_path:
            fd = os.open(reply.pool_path, os.O_RDWR)
            try:
                self._map = mmap.mmap(fd, reply.pool_bytes, flags=mmap.MAP_SHARED)
            finally:
                os.close(fd)
        return reply

    def begin_store(
        self, session_id: str, hashes: list[ChunkHash], op_id: int | None = None
    ) -> int:
        """Reserves slots and writes the pattern into them; the reservation stays until
        :meth:`commit` (or the server expires or aborts it). Returns the op id."""
        op_id = self.new_op_id() if op_id is None else op_id
        item = p.OpItem(session_id=session_id, chunk_hashes=hashes)
        plan = self.rpc.call(p.StoreBegin(op_id=op_id, epoch=self.epoch, items=[item]))
        assert isinstance(plan, p.StorePlan)
        for chunk_hash, slot in zip(hashes, plan.items[0].slots, strict=True):
            if slot is not None and self._map is not None:
                self._map[slot.offset : slot.offset + slot.nbytes] = pattern(
                    chunk_hash, slot.nbytes
                )
        return op_id

    def commit(self, op_id: int, ok: bool = True) -> p.StoreDone:
        reply = self.rpc.call(p.StoreCommit(op_id=op_id, ok=ok))
        assert isinstance(reply, p.StoreDone)
        return reply

    def store(self, session_id: str, hashes: list[ChunkHash]) -> int:
        """A whole store; returns the objects committed."""
        return self.commit(self.begin_store(session_id, hashes)).num_committed

    def begin_retrieve(
        self, session_id: str, handle: bytes, hashes: list[ChunkHash], op_id: int | None = None
    ) -> tuple[int, p.RetrievePlan]:
        """Pins the chunks (held until :meth:`end_retrieve`)."""
        op_id = self.new_op_id() if op_id is None else op_id
        item = p.OpItem(session_id=session_id, chunk_hashes=hashes, handle=handle)
        plan = self.rpc.call(p.RetrieveBegin(op_id=op_id, epoch=self.epoch, items=[item]))
        assert isinstance(plan, p.RetrievePlan)
        return op_id, plan

    def end_retrieve(
        self, op_id: int, plan: p.RetrievePlan, hashes: list[ChunkHash]
    ) -> tuple[int, int]:
        """Reads the pinned slots back, then ends the retrieve: (lock units released,
        chunks whose bytes differ from what was stored or that were missing)."""
        errors = 0
        for chunk_hash, slot in zip(hashes, plan.items[0].slots, strict=True):
            if slot is None:
                errors += 1
            elif self._map is not None:
                got = self._map[slot.offset : slot.offset + slot.nbytes]
                errors += got != pattern(chunk_hash, slot.nbytes)
        reply = self.rpc.call(p.RetrieveEnd(op_id=op_id, ok=[errors == 0]))
        assert isinstance(reply, p.RetrieveDone)
        return reply.num_locks_released, errors

    def retrieve(self, session_id: str, handle: bytes, hashes: list[ChunkHash]) -> int:
        """A whole retrieve; returns the chunks that were missing or wrong."""
        op_id, plan = self.begin_retrieve(session_id, handle, hashes)
        return self.end_retrieve(op_id, plan, hashes)[1]

    # --- scheduler -----------------------------------------------------------------------------

    def lookup(self, session_id: str, hashes: list[ChunkHash]) -> p.LookupResult:
        reply = self.rpc.call(
            p.Lookup(session_id=session_id, model=self.model, world_size=1, chunk_hashes=hashes)
        )
        assert isinstance(reply, p.LookupResult)
        return reply

    def free_locks(self, session_id: str) -> p.LocksFreed:
        reply = self.rpc.call(p.FreeLocks(session_id=session_id, end_token=1 << 40))
        assert isinstance(reply, p.LocksFreed)
        return reply

    def end_session(self, session_id: str) -> None:
        self.rpc.call(p.EndSession(session_id=session_id))

    def stats(self) -> p.ServerStats:
        reply = self.rpc.call(p.GetStats())
        assert isinstance(reply, p.ServerStats)
        return reply

    def cycle(self, label: str, num_chunks: int = 4) -> int:
        """Store, look up, retrieve and end a session of ``num_chunks`` new chunks; returns
        the integrity errors (chunks that did not hit, or came back wrong)."""
        hashes = chunk_hashes(label, num_chunks)
        self.store(f"{label}:store", hashes)
        session = f"{label}:read"
        found = self.lookup(session, hashes)
        errors = num_chunks - found.hit_chunks
        errors += self.retrieve(session, found.handle, hashes[: found.hit_chunks])
        self.end_session(session)
        return errors
