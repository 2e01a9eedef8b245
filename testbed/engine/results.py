"""What an engine run produced: one record per request plus run-level facts (plain data).

Engines drive; they do not count cache hits. A record holds only what the engine itself
knows about a workload request (its arrival, first token, end, generated tokens); what the
request got from vLLM's prefix cache and the cache server is computed from the run's
telemetry by ``testbed.analysis.attribution``, the same way for every engine and for a real
vLLM server. Each record's ``kvcache.request`` span is the root of the request's trace: the
connector's spans hang under it (engines pass its context to vLLM as the trace headers).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from testbed.core import telemetry
from testbed.core.telemetry import Span
from testbed.core.telemetry import attributes as a
from testbed.workloads import WorkloadRequest


@dataclass
class RequestRecord:
    request_id: str
    group: str
    prompt_tokens: int
    arrival_s: float
    output_tokens: int = 0
    scheduled_s: float | None = None
    """When the engine first scheduled the request (its queueing ends; replay and fleet)."""
    first_token_s: float | None = None
    finish_s: float | None = None
    hit_tokens: int | None = None
    """Only the oracle (no engine, no telemetry) reports hits here: its matched tokens."""
    unlimited_hit_tokens: int | None = None
    """The oracle with a capacity: the tokens an unlimited cache would have matched (the
    difference is its capacity misses)."""
    disk_hit_tokens: int | None = None
    """The oracle with a tier below L1: of ``hit_tokens``, those the disk tier served."""

    @property
    def ttft_ms(self) -> float | None:
        if self.first_token_s is None:
            return None
        return (self.first_token_s - self.arrival_s) * 1e3

    def row(self) -> dict[str, Any]:
        """The engine's facts of the request, for joining with the attribution table."""
        return {
            "request_id": self.request_id,
            "group": self.group,
            "arrival_s": self.arrival_s,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "scheduled_s": self.scheduled_s,
            "ttft_ms": self.ttft_ms,
            "finish_s": self.finish_s,
        }


OnFinish = Callable[[RequestRecord], None]
"""What an engine's ``run`` tells each request's record as the request finishes (a run's
progress bar, a test's observer)."""


@dataclass
class EngineResult:
    engine: str
    records: list[RequestRecord] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)
    """Requests the engine could never serve (longer than the model or the KV pool)."""
    integrity_errors: int = 0
    """KV blocks that did not hold what the engine would have computed (must be 0)."""
    steps: int = 0
    wall_s: float = 0.0
    virtual_s: float = 0.0
    """Projected time under the engine's cost model (replay), or wall time (vllm)."""
    metadata_only: bool = False
    output_token_ids: dict[str, list[int]] = field(default_factory=dict)
    """Generated tokens per request (engines with a real model)."""
    max_step_s: float = 0.0
    """The longest wall time of one engine step (a dead server must not stall a step for
    longer than the connector's timeout)."""
    effective: dict[str, Any] = field(default_factory=dict)
    """Settings the engine ran with where they differ from the spec (recorded, not hidden)."""


def open_request(request: WorkloadRequest, arrival_s: float) -> tuple[RequestRecord, Span]:
    """A request's record and its ``kvcache.request`` span: the parent of the connector spans
    of the request (engines pass its ``traceparent`` to vLLM as the request's trace headers)."""
    prompt_tokens = len(request.prompt_token_ids)
    span = telemetry.start_span(
        a.REQUEST,
        attributes={
            a.REQUEST_ID: request.request_id,
            a.PROMPT_TOKENS: prompt_tokens,
            a.REQUEST_GROUP: request.group,
            a.ARRIVAL_S: arrival_s,
        },
    )
    return RequestRecord(request.request_id, request.group, prompt_tokens, arrival_s), span


def close_request(record: RequestRecord, span: Span, integrity_errors: int = 0) -> None:
    """Ends the request's span with what the engine saw of it."""
    attributes: dict[str, Any] = {a.OUTPUT_TOKENS: record.output_tokens}
    if record.scheduled_s is not None:
        attributes[a.SCHEDULED_S] = record.scheduled_s
    if record.ttft_ms is not None:
        attributes[a.TTFT_MS] = record.ttft_ms
    if integrity_errors:
        attributes[a.INTEGRITY_ERRORS] = integrity_errors
    span.set_attributes(attributes)
    span.end()
