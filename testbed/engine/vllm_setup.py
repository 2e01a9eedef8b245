"""Building vLLM's configuration, scheduler and requests without workers or a model.

Used by the replay engine (and the connector's tests): vLLM's own ``Scheduler`` runs
unchanged; only the forward pass is replaced. The model configuration comes from a tiny
model directory written by :mod:`testbed.engine.model_dir` (no weights needed here).
"""

from __future__ import annotations

import copy
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.config import (
    CacheConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorBase_V1, KVConnectorRole
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.encoder_cache_manager import EncoderCacheManager
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from testbed.core.keys import KeyExtras
from testbed.spec.runspec import RunSpec
from testbed.workloads import WorkloadRequest

CONNECTOR_CLASS = "KVTBConnector"
CONNECTOR_MODULE = "connector.vllm_connector"


@dataclass(frozen=True)
class SchedulerSpec:
    """vLLM's configuration for a scheduler without workers: the run's spec (``run``: its
    block size, vLLM's batch limits, TP, prefix caching) and what vLLM needs besides."""

    model_dir: Path
    run: RunSpec = field(default_factory=RunSpec)
    num_blocks: int = 4096
    """vLLM's KV pool in blocks."""
    max_model_len: int = 8192
    connector_config: dict[str, Any] | None = None
    """``kv_connector_extra_config``; ``None`` runs without a connector."""
    kv_events: bool = False
    """vLLM's KV events (its own blocks' and the connector's): the scheduler collects them
    each step and hands them to its publisher (vLLM's null publisher here: replace
    ``scheduler.kv_event_publisher`` to receive them, as :mod:`testbed.fleet.kv_events` does)."""


def offline_environment() -> None:
    """No hub access (the model directory is local), replays size ``max_model_len`` from the
    workload, and vLLM's warnings stay quiet (standalone they would go to logging's
    last-resort handler as bare lines). Called before a configuration is built."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    logging.getLogger("vllm").setLevel(logging.ERROR)


def build_vllm_config(spec: SchedulerSpec) -> VllmConfig:
    offline_environment()
    run = spec.run
    model = ModelConfig(
        model=str(spec.model_dir),
        skip_tokenizer_init=True,
        max_model_len=spec.max_model_len,
        dtype="float16",
    )
    cache = CacheConfig(block_size=run.block_size, enable_prefix_caching=run.prefix_caching)
    scheduler = SchedulerConfig(
        max_num_batched_tokens=max(run.max_num_batched_tokens, run.block_size),
        max_num_seqs=run.max_num_seqs,
        enable_chunked_prefill=True,
        max_model_len=spec.max_model_len,
        is_encoder_decoder=False,
    )
    transfer = None
    if spec.connector_config is not None:
        transfer = kv_transfer_config(spec.connector_config)
    config = VllmConfig(
        model_config=model,
        cache_config=cache,
        scheduler_config=scheduler,
        kv_transfer_config=transfer,
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null")
        if spec.kv_events
        else None,
    )
    config.parallel_config.tensor_parallel_size = run.tp
    config.cache_config.num_gpu_blocks = spec.num_blocks
    return config


def kv_transfer_config(connector_config: dict[str, Any]) -> KVTransferConfig:
    """vLLM's transfer configuration naming our connector, with its ``kvtb.*`` settings."""
    return KVTransferConfig(
        kv_connector=CONNECTOR_CLASS,
        kv_connector_module_path=CONNECTOR_MODULE,
        kv_role="kv_both",
        # vLLM's default ("fail") would end a request whose chunk vanished; a best-effort
        # cache recomputes instead.
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=dict(connector_config),
    )


def build_kv_cache_config(config: VllmConfig, num_blocks: int) -> KVCacheConfig:
    model = config.model_config
    assert isinstance(model.dtype, torch.dtype)  # resolved by ModelConfig
    spec = FullAttentionSpec(
        block_size=config.cache_config.block_size,
        num_kv_heads=model.get_num_kv_heads(config.parallel_config),
        head_size=model.get_head_size(),
        dtype=model.dtype,
    )
    layers = [
        f"model.layers.{i}.self_attn.attn"
        for i in range(model.get_num_layers(config.parallel_config))
    ]
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)]
    )
    scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, config)
    kv_cache_config.hash_block_size = hash_block_size
    kv_cache_config.cache_hit_alignment_tokens = scheduler_block_size
    return kv_cache_config


def build_scheduler(
    config: VllmConfig, kv_cache_config: KVCacheConfig, *, log_stats: bool = False
) -> Scheduler:
    """vLLM's v1 scheduler; it creates the SCHEDULER-role connector itself.

    The tiny model is text-only, so vLLM would give the scheduler no encoder budget and it
    could never schedule past a multimodal placeholder; without an encoder to run, the replay
    gives it one as large as a step (requests with multimodal inputs then schedule as they
    would with a multimodal model whose encoder is free)."""
    assert kv_cache_config.cache_hit_alignment_tokens is not None
    scheduler = Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=kv_cache_config.cache_hit_alignment_tokens,
        hash_block_size=kv_cache_config.hash_block_size,
        log_stats=log_stats,
    )
    if not scheduler.max_num_encoder_input_tokens:
        budget = config.scheduler_config.max_num_batched_tokens
        scheduler.max_num_encoder_input_tokens = budget
        scheduler.encoder_cache_manager = EncoderCacheManager(cache_size=budget)
    return scheduler


def build_worker_connector(
    config: VllmConfig, kv_cache_config: KVCacheConfig, rank: int
) -> KVConnectorBase_V1:
    """The WORKER-role connector a model runner of TP rank ``rank`` would own."""
    rank_config = copy.copy(config)
    rank_config.parallel_config = copy.copy(config.parallel_config)
    rank_config.parallel_config.rank = rank
    return KVConnectorFactory.create_connector(rank_config, KVConnectorRole.WORKER, kv_cache_config)


class RequestFactory:
    """vLLM ``Request`` objects from token ids, hashed for prefix caching as EngineCore does."""

    def __init__(self, config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
        hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        assert kv_cache_config.hash_block_size is not None
        self._hasher = get_request_block_hasher(kv_cache_config.hash_block_size, hash_fn)
        self._lora_ids: dict[tuple[str, str], int] = {}

    def for_workload(self, request: WorkloadRequest, traceparent: str = "") -> Request:
        """vLLM's ``Request`` for a workload request: its prompt, output length and the keys'
        extras (LoRA adapter, multimodal inputs), carrying ``traceparent``."""
        return self.make(
            request.request_id,
            request.prompt_token_ids.tolist(),
            request.max_output_tokens,
            traceparent=traceparent,
            extras=request.key_extras,
        )

    def make(
        self,
        request_id: str,
        token_ids: list[int],
        max_tokens: int,
        *,
        traceparent: str = "",
        cache_salt: str | None = None,
        extras: KeyExtras | None = None,
    ) -> Request:
        """``extras``: the request's LoRA adapter and multimodal inputs, as vLLM's own request
        fields (a ``LoRARequest``, ``MultiModalFeatureSpec`` without data: no encoder runs)."""
        # Hand-made sampling params have no EOS token: exactly ``max_tokens`` outputs.
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        lora = None
        if extras is not None and extras.lora is not None:
            name, path = extras.lora
            lora_id = self._lora_ids.setdefault(extras.lora, len(self._lora_ids) + 1)
            lora = LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=path)
        features = [
            MultiModalFeatureSpec(
                data=None,
                modality="image",
                identifier=item.identifier,
                mm_position=PlaceholderRange(offset=item.offset, length=item.length),
                mm_hash=item.identifier,
            )
            for item in (extras.mm_inputs if extras is not None else ())
        ]
        return Request(
            request_id,
            token_ids,
            params,
            None,
            block_hasher=self._hasher,
            cache_salt=cache_salt,
            trace_headers={"traceparent": traceparent} if traceparent else None,
            lora_request=lora,
            mm_features=features or None,
        )
