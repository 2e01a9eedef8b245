"""The end-of-run invariant as tests check it: the server (or one run's sessions) holds
nothing (``testbed.core.quiescence``)."""

from __future__ import annotations

from testbed.core import protocol as p
from testbed.core.quiescence import Quiescence


def assert_quiescent(stats: p.ServerStats | p.Held) -> None:
    """Fails, naming what is still held, unless no lock, pin, reservation, retrieve or
    pending lookup is left."""
    state = Quiescence.of(stats)
    assert state.quiescent, f"the server is not quiescent: it {state}"
