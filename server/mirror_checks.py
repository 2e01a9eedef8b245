"""The server's side of the scheduler's lookup mirror (``connector.mirror``): how a lookup the
mirror predicted compares with what this server holds (wrong answers, over-estimates, the
span's attributes), and the order of a lookup nobody waits for and its request's stores.

Runs in the cache server process, inside the lookup and store handlers (``server.sessions``,
``server.transfers``). A lookup the mirror answered itself (``Lookup.lock`` False) brought
nothing up from the tiers below L1, so what they hold after its L1 hit is counted here. Its
request's first store, sent ``after_lookup`` on the worker's connection, waits until the
lookup was read (:class:`LookupOrder`), so the chunk log and spans see the lookup first.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Generator
from dataclasses import dataclass, field

from server.context import Call, Shared
from server.objects import Space
from server.state import ClientState
from testbed.core import protocol as p
from testbed.core.telemetry import attributes as a

log = logging.getLogger(__name__)

LOOKED_UP_IDS = 1 << 16
"""Sessions whose unlocked lookups the server remembers having read."""
AFTER_LOOKUP_S = 0.05
"""The longest a store sent ``after_lookup`` waits for its session's lookup (sent before it,
on the scheduler's connection: only a lookup the scheduler could not send is waited for this
long, and once: the client's later stores then wait for none)."""
AFTER_LOOKUP_PAUSE_S = 10.0
"""After a store waited in vain, how long no store waits for lookups."""


def count_mirror(s: Shared, call: Call, req: p.Lookup, hit: int) -> None:
    """A lookup the scheduler's mirror predicted: a wrong answer (it answered a miss itself,
    ``lock`` False, where this server holds more) or an over-estimate (it asked, predicting
    more than is held)."""
    predicted = req.mirror_hit_chunks or 0
    counters = s.counters
    wrong = 0
    if not req.lock:
        counters.mirror_answers += 1
        hit += _held_below(s, req, hit)  # not brought up: no load follows
        wrong = max(0, hit - max(predicted, req.engine_hit_tokens // s.config.chunk_size))
        if wrong:
            counters.mirror_wrong += 1
            counters.mirror_wrong_chunks += wrong
    elif predicted > hit:
        counters.mirror_overestimates += 1
    call.span.set_attributes(
        {
            a.MIRROR_HIT_CHUNKS: predicted,
            a.MIRROR_ANSWERED: not req.lock,
            a.MIRROR_WRONG_TOKENS: wrong * s.config.chunk_size,
        }
    )


def _held_below(s: Shared, req: p.Lookup, hit: int) -> int:
    """The chunks after an L1 hit of ``hit`` chunks that the tiers below L1 hold, in order."""
    if not s.tiers.enabled:
        return 0
    space = Space(req.model, req.world_size, req.cache_salt)
    below = 0
    for chunk_hash in req.chunk_hashes[hit:]:
        if not s.tiers.held_below(space.keys(chunk_hash)):
            break
        below += 1
    return below


@dataclass
class LookupOrder:
    """Which unlocked lookups the server has read (the latest :data:`LOOKED_UP_IDS`), for the
    stores sent ``after_lookup``; and, once a store waited in vain, a pause in all such waits
    (:data:`AFTER_LOOKUP_PAUSE_S`), so that no client can hold the loop by naming sessions
    nobody looks up. The order then is the order of arrival, as without the mirror's stores
    (the chunk log may name a miss by a later state; hits are never affected)."""

    looked_up: OrderedDict[str, None] = field(default_factory=OrderedDict)
    paused_until: float = 0.0
    vain_waits: int = 0

    def read(self, session_id: str) -> None:
        """The unlocked lookup of ``session_id`` was read."""
        self.looked_up[session_id] = None
        self.looked_up.move_to_end(session_id)
        if len(self.looked_up) > LOOKED_UP_IDS:
            self.looked_up.popitem(last=False)

    def after_lookups(
        self, s: Shared, client: ClientState, req: p.StoreBegin
    ) -> Generator[None, None, None]:
        """Waits (other clients served meanwhile, this one's later requests behind it) until
        the lookups of the items sent ``after_lookup`` were read, or :data:`AFTER_LOOKUP_S`:
        a lookup nobody waited for then sees the cache as it was before its request's stores."""
        if not client.waits_for_lookups or s.clock() < self.paused_until:
            return
        waiting = {item.session_id for item in req.items if item.after_lookup}
        deadline = s.clock() + min(s.config.lookup_pending_timeout_s, AFTER_LOOKUP_S)
        while waiting:
            waiting = {sid for sid in waiting if sid not in self.looked_up}
            if waiting and s.clock() >= deadline:
                client.waits_for_lookups = False
                self.paused_until = s.clock() + AFTER_LOOKUP_PAUSE_S
                self.vain_waits += 1
                log.warning("a store waited in vain for the lookups of %s", sorted(waiting))
                return
            if waiting:
                yield
