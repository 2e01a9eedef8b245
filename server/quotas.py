"""Per-client quotas beside the server-wide limits: no client can starve the others.

Runs in the cache server process (called by the handlers of ``server.service``). A client is
one connection. The server-wide limits (``--max-sessions``, ``--max-tracked-chunks``, ...)
bound the server's memory; the quotas bound one client's share of them, so that a client
that takes all it can (a bug, or a hostile holder of the client token) is refused alone while
the others go on:

- ``max_sessions_per_client``: live sessions (over it: refused);
- ``max_tracked_chunks_per_client``: chunks it has tracked, in its lock groups (what its
  lookups locked) and its sessions' refresh lists (a lookup over it is refused; a store's
  chunks are simply not refreshed at the session's end, as over the server-wide limit);
- ``max_inflight_ops_per_client``: stores and retrieves begun and not finished (refused);
- ``max_pending_lookups_per_client``: lookups left pending on in-flight stores (answered).

A refusal is an ``Error`` with code ``quota`` (``testbed.core.protocol.LIMIT_CODES``) naming the
quota and its flag; clients count it as a limit refusal, not as a failure of the server. Over
the pending-lookup quota a lookup is answered at once (the chunk whose store is in flight is
then a miss, ``in_flight``) instead of waiting: nothing is refused.
"""

from __future__ import annotations

from collections.abc import Mapping

from server.context import ServiceError, Shared
from server.state import ClientState, Session


def check_sessions(s: Shared, client: ClientState) -> None:
    """Refuses a new session of ``client`` beyond ``max_sessions_per_client``."""
    quota = s.config.max_sessions_per_client
    if len(client.sessions) >= quota:
        raise _refuse(s, "max_sessions_per_client", quota, "live sessions")


def tracked_fits(s: Shared, client: ClientState, added: int) -> bool:
    """Whether ``client`` may track ``added`` more chunks within
    ``max_tracked_chunks_per_client`` (its lock groups and its sessions' refresh lists)."""
    tracked = s.cache.locked_chunks_of(client.client_id) + client.tracked_chunks
    return added <= 0 or tracked + added <= s.config.tracked_chunks_quota


def refuse_tracked(s: Shared) -> ServiceError:
    """The refusal of a lookup that would take ``client`` over its tracked-chunks quota."""
    quota = s.config.tracked_chunks_quota
    return _refuse(s, "max_tracked_chunks_per_client", quota, "tracked chunks")


def check_ops(s: Shared, client: ClientState) -> None:
    """Refuses a store or retrieve of ``client`` beyond ``max_inflight_ops_per_client``."""
    quota = s.config.max_inflight_ops_per_client
    if len(client.stores) + len(client.retrieves) >= quota:
        raise _refuse(s, "max_inflight_ops_per_client", quota, "operations in flight")


def may_wait(s: Shared, sessions: Mapping[str, Session], client: ClientState) -> bool:
    """Whether one more lookup of ``client`` (whose sessions are among ``sessions``) may be
    left pending (else it settles now)."""
    pending = 0
    for session_id in client.sessions:
        session = sessions.get(session_id)
        pending += session is not None and session.pending is not None
    if pending < s.config.max_pending_lookups_per_client:
        return True
    s.counters.quota_settled += 1
    return False


def _refuse(s: Shared, name: str, value: int, what: str) -> ServiceError:
    s.counters.refused_quotas += 1
    flag = "--" + name.replace("_", "-")
    return ServiceError(
        "quota",
        f"refused: over this client's quota of {value} {what} ({flag}); other clients are "
        "not affected",
    )
