"""What a run asks its cache server once its engine is done: the server's counters and what
the run itself left there.

Runs in the ``kvtb run`` process (``testbed.run``). With several runs on one server the
server's totals are everyone's; a run's quiescence is its own: the locks, pins, operations in
flight, pending lookups and sessions of its sessions (``<run id>:<request id>``), which the
server reports for one owner (``get_held``, ``server.held``). The run's last messages (frees,
session ends) travel on other connections than the question, so it is asked again for up to
a second until nothing is held.

A server that answered the run until its end gets :data:`ANSWER_TIMEOUT_S` to answer the
question (a loaded machine's writeback can stall its writes for seconds: it is slow, not gone);
one the run's clients already saw stop answering gets :data:`GONE_TIMEOUT_S`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import msgspec

from testbed.core import protocol as p
from testbed.core.credentials import ServerEndpoint
from testbed.core.quiescence import run_quiescent
from testbed.core.rpc import RemoteError, RpcClient, ServerUnavailable
from testbed.core.server_health import health_of

ANSWER_TIMEOUT_S = 10.0
GONE_TIMEOUT_S = 2.0


def server_state_after(endpoint: ServerEndpoint, owners: Sequence[str]) -> dict[str, Any] | None:
    """The server's counters after the run and, with ``owners`` (the engine ids of the run's
    sessions: one, or one per fleet instance), what the run itself left there (``held``,
    summed over the owners; see ``server.held``); ``None`` if the server is gone."""
    timeout_s = ANSWER_TIMEOUT_S if health_of(endpoint.url).alive else GONE_TIMEOUT_S
    try:
        with RpcClient(endpoint.url, role="run", token=endpoint.token, timeout_s=timeout_s) as c:
            held = [_held_after(c, owner) for owner in owners]
            reply = c.call(p.GetStats(), timeout_s=timeout_s)
    except (ServerUnavailable, RemoteError):
        return None
    assert isinstance(reply, p.ServerStats)
    state: dict[str, Any] = _fields(reply)
    if held:
        state["held"] = _summed([_fields(h) for h in held])
    return state


def merged_states(states: Sequence[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Several servers' states as one (a fleet with a server per instance): counts summed,
    ``held`` too; ``None`` if one of them could not be asked."""
    if not states or any(state is None for state in states):
        return None
    helds = [state["held"] for state in states if state is not None and "held" in state]
    merged = _summed([{k: v for k, v in s.items() if k != "held"} for s in states if s])
    if helds:
        merged["held"] = _summed(helds)
    return merged


def _summed(counts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Counts added key by key: numbers summed, tables (``errors_by_code``, the tiers by name,
    a server's peer counts) key by key, lists of tiers' usage tier by tier, text (a tier's
    kind) kept from the first, ``None`` (nothing to report) left out of the sum."""
    total: dict[str, Any] = {}
    for count in counts:
        for key, value in count.items():
            if value is None:
                total.setdefault(key, None)
            elif total.get(key) is None:
                total[key] = value
            else:
                total[key] = _added(total[key], value)
    return total


def _added(first: Any, second: Any) -> Any:
    if isinstance(first, str):  # a tier's kind: the first server's
        return first
    if isinstance(first, dict):
        return _summed([first, second])
    if isinstance(first, list):  # tiers, by name, in the first server's order
        by_tier = {tier["tier"]: dict(tier) for tier in first}
        for tier in second:
            known = by_tier.setdefault(tier["tier"], {"tier": tier["tier"]})
            known.update(_summed([{k: v for k, v in known.items() if k != "tier"},
                                  {k: v for k, v in tier.items() if k != "tier"}]))  # fmt: skip
        return list(by_tier.values())
    return first + second


def _held_after(client: RpcClient, owner: str, settle_s: float = 1.0) -> p.Held:
    """What ``owner``'s sessions hold once the run's last messages (fire and forget, on other
    connections) have arrived: asked until nothing is held or ``settle_s`` passed."""
    deadline = time.monotonic() + settle_s
    while True:
        held = client.call(p.GetHeld(owner=owner))  # the client's timeout
        assert isinstance(held, p.Held)
        if run_quiescent(held) or time.monotonic() >= deadline:
            return held
        time.sleep(0.05)


def _fields(message: p.Reply) -> dict[str, Any]:
    """A reply's fields as JSON values (a summary's), without the envelope's; a server's
    ``tiers`` as a table by tier name (``L2``: its counts)."""
    fields = {
        name: msgspec.to_builtins(getattr(message, name))
        for name in message.__struct_fields__
        if name not in ("v", "rid", "epoch")
    }
    if "tiers" in fields:
        fields["tiers"] = {
            tier["name"]: {k: v for k, v in tier.items() if k != "name"} for tier in fields["tiers"]
        }
    return fields
