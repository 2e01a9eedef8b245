"""What a run asks its cache server once its engine is done: the server's counters and what
the run itself left there.

Runs in the ``kvtb run`` process (``testbed.run``). With several runs on one server the
server's totals are everyone's; a run's quiescence is its own: the locks, pins, operations in
flight, pending lookups and sessions of its sessions (``<run id>:<request id>``), which the
server reports for one owner (``get_held``, ``server.held``). The run's last messages (frees,
session ends) travel on other connections than the question, so it is asked again for up to
a second until nothing is held.
"""

from __future__ import annotations

import time
from typing import Any

from testbed import protocol as p
from testbed.credentials import ServerEndpoint
from testbed.rpc import RemoteError, RpcClient, ServerUnavailable


def server_state_after(endpoint: ServerEndpoint, owner: str | None) -> dict[str, Any] | None:
    """The server's counters after the run and, with ``owner`` (the engine id of the run's
    sessions), what the run itself left there (``held``; see ``server.held``); ``None`` if the
    server is gone."""
    try:
        with RpcClient(endpoint.url, role="run", token=endpoint.token, timeout_s=2.0) as client:
            held = None if owner is None else _held_after(client, owner)
            reply = client.call(p.GetStats(), timeout_s=2.0)
    except (ServerUnavailable, RemoteError):
        return None
    assert isinstance(reply, p.ServerStats)
    state: dict[str, Any] = _fields(reply)
    if held is not None:
        state["held"] = _fields(held)
    return state


def _held_after(client: RpcClient, owner: str, settle_s: float = 1.0) -> p.Held:
    """What ``owner``'s sessions hold once the run's last messages (fire and forget, on other
    connections) have arrived: asked until nothing is held or ``settle_s`` passed."""
    deadline = time.monotonic() + settle_s
    while True:
        held = client.call(p.GetHeld(owner=owner), timeout_s=2.0)
        assert isinstance(held, p.Held)
        if not any(_fields(held).values()) or time.monotonic() >= deadline:
            return held
        time.sleep(0.05)


def _fields(message: p.Reply) -> dict[str, Any]:
    return {
        name: getattr(message, name)
        for name in message.__struct_fields__
        if name not in ("v", "rid", "epoch")
    }
