"""The ``serve`` engine: a workload sent over HTTP to running OpenAI-compatible vLLM servers.

The server runs our connector (``kv_connector: KVTBConnector``) against a ``kvtb server``;
this engine only plays the clients. Each request is a streamed ``/v1/completions`` call with
the prompt as token ids, sent at its arrival time (``trace``) or at once (``all``) with at most
``max_concurrency`` in flight, and a W3C ``traceparent`` header naming its ``kvcache.request``
span: vLLM hands the header to the request, so the connector's spans (which the connector
writes where ``kvtb.span_dir`` / ``KVTB_SPAN_DIR`` says) are children of it, one trace per
request. The engine records what a client sees: time to first token, end, generated tokens,
and the ``cached_tokens`` vLLM reports in the usage (``--enable-prompt-tokens-details``).
With several servers (a fleet), a router decides each request's server as it arrives
(:mod:`testbed.fleet.serve_routing`), and each server has ``max_concurrency`` slots. A
request's span opens at its arrival: its TTFT counts waiting for a slot, as a server's queue.
What the request got from the caches is then read from the telemetry, as for every engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from testbed.core import telemetry
from testbed.core.closing import Closing
from testbed.core.telemetry import attributes as a
from testbed.engine.results import (
    EngineResult,
    OnFinish,
    RequestRecord,
    close_request,
    open_request,
)
from testbed.workloads import WorkloadRequest

if TYPE_CHECKING:
    from testbed.fleet.serve_routing import ServeRouting


@dataclass(frozen=True)
class ServeSpec:
    endpoints: tuple[str, ...]
    """The vLLM servers' base URLs, e.g. ``http://127.0.0.1:8000`` (several: a fleet, routed
    by the engine's :class:`~testbed.fleet.serve_routing.ServeRouting`)."""
    model: str | None = None
    """The served model's name; ``None``: the first one ``/v1/models`` lists."""
    max_concurrency: int = 16
    """Requests in flight per server at most."""
    arrival: str = "trace"
    """``trace``: each request at its arrival time; ``all``: as fast as concurrency allows."""
    timeout_s: float = 600.0
    """Longest wait for one response."""

    def __post_init__(self) -> None:
        if isinstance(self.endpoints, str):
            raise TypeError("endpoints is a sequence of URLs: give (url,) for one server")
        if not self.endpoints:
            raise ValueError("give at least one endpoint")
        for endpoint in self.endpoints:
            if not endpoint.startswith(("http://", "https://")):
                raise ValueError(f"endpoint {endpoint!r} must be an http(s):// URL")
        if self.max_concurrency < 1:
            raise ValueError("max_concurrency must be at least 1")
        if self.arrival not in ("trace", "all"):
            raise ValueError(f"arrival must be 'trace' or 'all', got {self.arrival!r}")


class ServeEngine(Closing):
    """Context manager (nothing to close: the servers are someone else's). With several
    endpoints, ``routing`` decides each request's server."""

    def __init__(self, spec: ServeSpec, routing: ServeRouting | None = None) -> None:
        if len(spec.endpoints) > 1 and routing is None:
            raise ValueError(f"{len(spec.endpoints)} endpoints need a router")
        self.spec = spec
        self.routing = routing

    def close(self) -> None:
        """Nothing to release: the servers are someone else's."""

    def run(
        self, requests: Iterable[WorkloadRequest], on_finish: OnFinish | None = None
    ) -> EngineResult:
        return asyncio.run(self._run(list(requests), on_finish))

    async def _run(
        self,
        requests: list[WorkloadRequest],
        on_finish: OnFinish | None,
    ) -> EngineResult:
        import aiohttp

        result = EngineResult(engine="serve")
        timeout = aiohttp.ClientTimeout(total=self.spec.timeout_s)
        endpoints = self.spec.endpoints
        slots = [asyncio.Semaphore(self.spec.max_concurrency) for _ in endpoints]
        started = time.perf_counter()
        async with contextlib.AsyncExitStack() as stack:
            clients = [
                await stack.enter_async_context(
                    aiohttp.ClientSession(base_url=endpoint, timeout=timeout)
                )
                for endpoint in endpoints
            ]
            model = self.spec.model or await _first_model(clients[0])
            result.effective = {"endpoints": list(endpoints), "served_model": model}
            if len(endpoints) == 1:
                result.effective["endpoint"] = endpoints[0]

            async def one(request: WorkloadRequest) -> None:
                if self.spec.arrival == "trace":
                    delay = request.arrival_s - (time.perf_counter() - started)
                    if delay > 0:
                        await asyncio.sleep(delay)
                record, span = open_request(request, time.perf_counter() - started)
                instance = 0
                if self.routing is not None:
                    instance = self.routing.place(request, span, record.arrival_s)
                async with slots[instance]:
                    await self._send(clients[instance], model, request, record, span, started)
                if self.routing is not None:
                    self.routing.finished(request.request_id)
                result.records.append(record)
                if on_finish is not None:
                    on_finish(record)

            await asyncio.gather(*(one(request) for request in requests))
        result.wall_s = result.virtual_s = time.perf_counter() - started
        result.steps = len(result.records)
        return result

    async def _send(
        self,
        http: Any,
        model: str,
        request: WorkloadRequest,
        record: RequestRecord,
        span: Any,
        started: float,
    ) -> None:
        headers = {"X-Request-Id": request.request_id}
        traceparent = telemetry.traceparent_of(span)
        if traceparent:
            headers["traceparent"] = traceparent
        body = {
            "model": model,
            "prompt": request.prompt_token_ids.tolist(),
            "max_tokens": request.max_output_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        usage: dict[str, Any] = {}
        client_id: str | None = None
        try:
            async with http.post("/v1/completions", json=body, headers=headers) as response:
                if response.status != 200:
                    message = (await response.text())[:500]
                    raise RuntimeError(f"HTTP {response.status}: {message}")
                async for raw in response.content:
                    line = raw.decode().strip()
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    event = json.loads(line.removeprefix("data:"))
                    if client_id is None and event.get("id"):
                        client_id = str(event["id"])  # the id a client sees (cmpl-...)
                        span.set_attribute(a.CLIENT_REQUEST_ID, client_id)
                    if event.get("choices") and record.first_token_s is None:
                        record.first_token_s = time.perf_counter() - started
                        if self.routing is not None:
                            self.routing.first_token(request.request_id)
                    if event.get("usage"):
                        usage = event["usage"]
        except Exception as exc:
            telemetry.fail(span, f"the vLLM server failed the request: {exc}")
            span.set_attribute(a.ERROR, str(exc)[:500])
        record.finish_s = time.perf_counter() - started
        record.output_tokens = int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            span.set_attribute(a.VLLM_CACHED_TOKENS, int(details["cached_tokens"]))
        close_request(record, span)


async def _first_model(http: Any) -> str:
    async with http.get("/v1/models") as response:
        models = (await response.json()).get("data") or []
    if not models:
        raise RuntimeError("the vLLM server lists no model at /v1/models")
    return str(models[0]["id"])
