"""How a run is executed beyond its spec: the cache server to use, where progress goes, and the
serve engine's targets (none of it changes what the run measures, so none of it is in the run
id)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from testbed.core.credentials import ServerEndpoint


@dataclass(frozen=True)
class RunOptions:
    server: ServerEndpoint | None = None
    """Use this running server instead of starting one (its spans and chunk log stay with it;
    the run records the server's real capacity and policy)."""
    progress: bool = True
    otlp_endpoint: str | None = None
    otlp_protocol: str | None = None
    on_progress: Callable[[int, int], None] | None = None
    """Called with (requests done, requests total) as requests finish."""
    on_wait: Callable[[str | None], None] | None = None
    """Called while a long start holds the first request back (vLLM's server starting), with
    what it waits for, about once a second; then once with ``None`` when serving begins."""
    endpoint: str | None = None
    """serve engine: a running vLLM OpenAI server (with the connector) to send the workload
    to; its connector and cache server keep their telemetry where they were told."""
    endpoints: tuple[str, ...] = ()
    """serve engine: several running vLLM OpenAI servers, routed by the spec's router (as many
    as the spec's ``instances``)."""
    launch: bool = False
    """serve engine: start ``kvtb server`` and vLLM's OpenAI server for the run (their
    telemetry lands in the run directory), and stop them after."""
    asked: frozenset[str] | None = None
    """The spec's keys the user gave (a flag or a config key): with ``server``, a policy or a
    pool medium asked must be the server's, one not asked is taken from it. ``None``: every
    key counts as asked (a spec built in code)."""

    @property
    def serve_urls(self) -> list[str]:
        """The running vLLM servers the serve engine is given (``endpoints``, or ``endpoint``)."""
        return list(self.endpoints) or ([self.endpoint] if self.endpoint else [])
