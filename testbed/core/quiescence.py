"""The quiescence record: what a cache server (or one engine's sessions) still holds.

A server is *quiescent* when it holds no read lock, no pin, no store reservation, no retrieve
in flight and no pending lookup: the end-of-run invariant. The server builds the record from
its own state (``server.service``) and reports it in every ``ServerStats``; a client builds it
from that reply, or from the ``Held`` reply about one engine's sessions (``GetHeld``), with
:meth:`Quiescence.of`. Live sessions are not part of it (a shared server has other runs'); a
run that asks about its own sessions also checks that it left none (:func:`run_quiescent`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from testbed.core import protocol as p


@dataclass(frozen=True)
class Quiescence:
    """Counts of what is still held; all zero: quiescent."""

    num_locks: int
    """Read-lock units of live lock groups."""
    num_pins: int
    """Pins of objects being copied out (retrieves in flight)."""
    num_inflight_stores: int
    """Stores begun and neither committed nor aborted (their reservations)."""
    num_inflight_retrieves: int
    num_pending_lookups: int
    """Lookups answered ``pending`` and not settled yet."""

    @classmethod
    def of(cls, reply: p.ServerStats | p.Held) -> Quiescence:
        return cls(**{name: getattr(reply, name) for name in QUIESCENCE_KEYS})

    @property
    def quiescent(self) -> bool:
        return not any(self.as_dict().values())

    @property
    def num_inflight(self) -> int:
        """Operations still open: store reservations, retrieves and pending lookups."""
        return self.num_inflight_stores + self.num_inflight_retrieves + self.num_pending_lookups

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def __str__(self) -> str:
        held = [f"{name}={value}" for name, value in self.as_dict().items() if value]
        return "quiescent" if not held else "holds " + ", ".join(held)


QUIESCENCE_KEYS: tuple[str, ...] = tuple(field.name for field in fields(Quiescence))
"""The record's fields, in order (the ``ServerStats`` / ``Held`` fields of the same names)."""
RUN_QUIESCENCE_KEYS: tuple[str, ...] = (*QUIESCENCE_KEYS, "num_sessions")
"""What one run leaves none of on its server (``Held`` about its own sessions): the record's
counts, and sessions."""


def run_quiescent(held: p.Held) -> bool:
    """Whether one engine's sessions left nothing: quiescent, and no session of its own."""
    return Quiescence.of(held).quiescent and held.num_sessions == 0
