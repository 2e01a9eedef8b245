"""A client with operations open while another client misbehaves, and the check that the
misbehaviour left them intact.

Runs in the chaos process (the ``fuzz`` and ``unauthenticated`` scenarios, and the fuzz
test). :meth:`OpenOperations.open` stores chunks in session ``NAME:0``, looks them up in
``NAME:1`` and pins the first of them by a retrieve, and reserves a store of new chunks in
``NAME:2``; the hostile client is then told those sessions, op ids and handle.
:meth:`OpenOperations.finish` ends all of it and reads every chunk back in ``NAME:3``: what
differs from an undisturbed run is what the hostile client did to it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from testbed.chaos.probes import ProbeClient
from testbed.core import protocol as p
from testbed.core.keys import ChunkHash


@dataclass(frozen=True, eq=False)
class OpenOperations:
    """A client's lock group, pin and reservation, open (see the module docstring)."""

    client: ProbeClient
    name: str
    stored: list[ChunkHash]
    """Chunks stored; the lookup of session ``NAME:1`` holds their locks."""
    reserved: list[ChunkHash]
    """Chunks whose store is reserved and not committed (op ``store_op``)."""
    found: p.LookupResult
    pinned: int
    """The first ``pinned`` of ``stored`` are pinned by a retrieve (op ``retrieve_op``)."""
    retrieve_op: int
    retrieve_plan: p.RetrievePlan
    store_op: int

    @classmethod
    def open(
        cls,
        client: ProbeClient,
        name: str,
        stored: list[ChunkHash],
        reserved: list[ChunkHash],
        *,
        pinned: int,
        retrieve_op: int,
        store_op: int,
    ) -> OpenOperations:
        client.store(f"{name}:0", stored)
        found = client.lookup(f"{name}:1", stored)
        _, plan = client.begin_retrieve(
            f"{name}:1", found.handle, stored[:pinned], op_id=retrieve_op
        )
        client.begin_store(f"{name}:2", reserved, op_id=store_op)
        return cls(client, name, stored, reserved, found, pinned, retrieve_op, plan, store_op)

    @property
    def sessions(self) -> tuple[str, str]:
        """The sessions a hostile client may name: the lookup's and the store's."""
        return f"{self.name}:1", f"{self.name}:2"

    def finish(self) -> Iterator[str]:
        """Ends the retrieve, commits the store, frees the lookup's other locks, reads every
        chunk back and ends the sessions, yielding as it goes what differs from an undisturbed
        run (nothing: intact). A request that fails raises (``RemoteError``,
        ``ServerUnavailable``) after what was yielded before it."""
        client, name = self.client, self.name
        released, errors = client.end_retrieve(
            self.retrieve_op, self.retrieve_plan, self.stored[: self.pinned]
        )
        if (released, errors) != (self.pinned, 0):
            yield f"its retrieve released {released} locks ({self.pinned}) with {errors} errors"
        committed = client.commit(self.store_op).num_committed
        if committed != len(self.reserved):
            yield f"its store committed {committed} of {len(self.reserved)}"
        locked = len(self.stored) - self.pinned
        freed = client.free_locks(f"{name}:1").num_locks
        if freed != locked:
            yield f"{freed} of its locks were left to free, not {locked}"
        every = self.stored + self.reserved
        again = client.lookup(f"{name}:3", every)
        if again.hit_chunks != len(every):
            yield f"its data: {again.hit_chunks} of {len(every)} chunks hit"
        wrong = client.retrieve(f"{name}:3", again.handle, every[: again.hit_chunks])
        if wrong:
            yield f"its data: {wrong} chunks came back wrong"
        for session in (f"{name}:1", f"{name}:3"):
            client.end_session(session)
