"""What an engine run produced: one record per request plus run-level counters (plain data)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from testbed import telemetry
from testbed.telemetry import Span
from testbed.telemetry import attributes as a
from testbed.workloads import WorkloadRequest


@dataclass
class RequestRecord:
    request_id: str
    group: str
    prompt_tokens: int
    arrival_s: float
    output_tokens: int = 0
    hit_tokens: int = 0
    """Prompt tokens the request did not compute at its first admission: the engine's own
    prefix-cache hit plus what loaded from the cache server (failed loads excluded)."""
    engine_hit_tokens: int = 0
    """Prompt tokens the engine's own prefix cache held at admission."""
    load_failed_tokens: int = 0
    """Tokens the cache was to load but could not (chunks gone since the lookup): recomputed."""
    preemptions: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None

    @property
    def external_hit_tokens(self) -> int:
        """Prompt tokens loaded from the cache server beyond the engine's own hit."""
        return max(0, self.hit_tokens - self.engine_hit_tokens)

    @property
    def recomputed_tokens(self) -> int:
        return self.prompt_tokens - self.engine_hit_tokens - self.external_hit_tokens

    def row(self) -> dict[str, Any]:
        """The record as one row of a run's ``metrics.parquet``."""
        return {
            "request_id": self.request_id,
            "group": self.group,
            "arrival_s": self.arrival_s,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "engine_hit_tokens": self.engine_hit_tokens,
            "external_hit_tokens": self.external_hit_tokens,
            "recomputed_tokens": self.recomputed_tokens,
            "load_failed_tokens": self.load_failed_tokens,
            "preemptions": self.preemptions,
            "ttft_ms": self.ttft_ms,
        }

    @property
    def ttft_ms(self) -> float | None:
        if self.first_token_s is None:
            return None
        return (self.first_token_s - self.arrival_s) * 1e3


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


def open_request(request: WorkloadRequest, arrival_s: float) -> tuple[RequestRecord, Span]:
    """A request's record and its ``kvcache.request`` span: the parent of the connector spans
    of the request (engines pass its ``traceparent`` to vLLM as the request's trace headers)."""
    prompt_tokens = len(request.prompt_token_ids)
    span = telemetry.start_span(
        a.REQUEST, attributes={a.REQUEST_ID: request.request_id, a.PROMPT_TOKENS: prompt_tokens}
    )
    return RequestRecord(request.request_id, request.group, prompt_tokens, arrival_s), span


def close_request(record: RequestRecord, span: Span) -> None:
    """Ends the request's span with what the request got from the caches."""
    span.set_attributes(_request_attributes(record))
    span.end()


def _request_attributes(record: RequestRecord) -> dict[str, Any]:
    return {
        a.ENGINE_HIT_TOKENS: record.engine_hit_tokens,
        a.EXTERNAL_HIT_TOKENS: record.external_hit_tokens,
        a.RECOMPUTED_TOKENS: record.recomputed_tokens,
        a.LOAD_FAILED_TOKENS: record.load_failed_tokens,
        a.OUTPUT_TOKENS: record.output_tokens,
        a.PREEMPTIONS: record.preemptions,
        a.GEN_AI_CACHE_READ_TOKENS: record.engine_hit_tokens + record.external_hit_tokens,
        a.TTFT_MS: record.ttft_ms if record.ttft_ms is not None else -1.0,
        a.REQUEST_GROUP: record.group,
    }
