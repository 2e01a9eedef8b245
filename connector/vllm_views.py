"""Conversions from vLLM's objects to the connector's plain ones (part of the vLLM shim).

Used by :mod:`connector.vllm_connector` in vLLM's scheduler and worker processes; vLLM's types
appear only in signatures. What comes out (:class:`connector.scheduler.RequestView`,
:class:`connector.scheduler.ScheduledRequest`, :class:`testbed.core.keys.KeyExtras`) is plain data
the pure core works on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from connector.scheduler import RequestView, ScheduledRequest
from testbed.core.keys import KeyExtras, MultiModalInput

if TYPE_CHECKING:
    import torch
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.request import Request


def request_view(request: Request) -> RequestView:
    headers = request.trace_headers or {}
    return RequestView(
        request_id=request.request_id,
        token_ids=request.all_token_ids,
        num_prompt_tokens=request.num_prompt_tokens,
        num_tokens=request.num_tokens,
        cache_salt=request.cache_salt or "",
        traceparent=headers.get("traceparent", ""),
        key_extras=key_extras(request),
    )


def key_extras(request: Request) -> KeyExtras | None:
    """What vLLM's block hashes add to a request's tokens: its LoRA adapter (name and path)
    and its multimodal inputs (identifier and placeholder range)."""
    lora = request.lora_request
    inputs = tuple(
        MultiModalInput(f.identifier, f.mm_position.offset, f.mm_position.length)
        for f in request.mm_features or ()
    )
    if lora is None and not inputs:
        return None
    return KeyExtras(lora=(lora.lora_name, lora.lora_path) if lora else None, mm_inputs=inputs)


def scheduled_requests(output: SchedulerOutput) -> list[ScheduledRequest]:
    steps = [
        ScheduledRequest(
            request_id=new.req_id,
            num_computed_tokens=new.num_computed_tokens,
            num_scheduled_tokens=output.num_scheduled_tokens[new.req_id],
            block_ids=single_group(new.block_ids),
            all_blocks=True,
        )
        for new in output.scheduled_new_reqs
    ]
    cached = output.scheduled_cached_reqs
    for index, request_id in enumerate(cached.req_ids):
        new_blocks = cached.new_block_ids[index]
        steps.append(
            ScheduledRequest(
                request_id=request_id,
                num_computed_tokens=cached.num_computed_tokens[index],
                num_scheduled_tokens=output.num_scheduled_tokens[request_id],
                block_ids=single_group(new_blocks) if new_blocks is not None else [],
                all_blocks=request_id in cached.resumed_req_ids,
            )
        )
    return steps


def single_group(block_ids: tuple[list[int], ...] | list[list[int]]) -> list[int]:
    if len(block_ids) != 1:
        raise RuntimeError(
            "KVTBConnector supports one KV cache group; start vLLM with "
            "--disable-hybrid-kv-cache-manager"
        )
    return list(block_ids[0])


def block_dim_of(layer: torch.Tensor, num_blocks: int | None) -> int:
    """The dimension of a paged KV tensor that indexes blocks."""
    if num_blocks is not None:
        matches = [dim for dim, size in enumerate(layer.shape) if size == num_blocks]
        if len(matches) == 1:
            return matches[0]
        if matches:
            # (num_blocks, 2, ...) or (2, num_blocks, ...): vLLM puts blocks in front of or
            # right after the K/V split.
            return matches[0] if layer.shape[0] != 2 else 1
    raise ValueError(
        f"cannot tell which dimension of the KV cache of shape {tuple(layer.shape)} holds the "
        f"{num_blocks} blocks"
    )


def vllm_hit_sources(split: dict[str, int]) -> dict[CacheHitSource, int]:
    """A hit's tokens by our hit-source names (``host``, ``disk``, ``remote``, ``p2p``) as
    vLLM's ``CacheHitSource``; ``remote`` has no name of vLLM's and counts as
    ``external_unspecified``."""
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    named = {"host": CacheHitSource.HOST, "disk": CacheHitSource.DISK, "p2p": CacheHitSource.P2P}
    sources: dict[CacheHitSource, int] = {}
    for name, tokens in split.items():
        source = named.get(name, CacheHitSource.EXTERNAL_UNSPECIFIED)
        sources[source] = sources.get(source, 0) + tokens
    return sources
