"""What one engine's sessions still hold on a server that others share.

Runs in the cache server process, for the handler of ``get_held`` (``server.sessions``).
Everything the server holds is named by a session: a lock group by the session whose lookup
took it, a pin or a reservation by the sessions of its operation's items, a pending lookup by
its session. An engine's session ids are ``<engine id>:<request id>`` (the connector's
``engine_id``; a run's id for ``kvtb run``), so what one engine left, and only what it left,
is what the sessions with its prefix hold: a run's end-of-run quiescence is its own, however
many other runs share the server.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from server.cache import KVCache
from server.state import ClientState, Session
from testbed.core import protocol as p


def held_by(
    cache: KVCache, clients: Iterable[ClientState], sessions: Mapping[str, Session], owner: str
) -> p.Held:
    """What the sessions named ``<owner>:...`` hold now."""
    prefix = f"{owner}:"
    held = p.Held()
    held.num_locks = sum(
        group.num_units for group in cache.groups.values() if group.session_id.startswith(prefix)
    )
    for client in clients:
        for store in client.stores.values():
            held.num_inflight_stores += any(sid.startswith(prefix) for sid in store.session_ids)
        for retrieve in client.retrieves.values():
            mine = [item for item in retrieve.items if item[0].startswith(prefix)]
            held.num_inflight_retrieves += bool(mine)
            held.num_pins += sum(sum(present) for _, _, _, present in mine)
    for session_id, session in sessions.items():
        if session_id.startswith(prefix):
            held.num_sessions += 1
            held.num_pending_lookups += session.pending is not None
    return held
