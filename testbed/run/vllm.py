"""The vllm engine's run (the full vLLM engine in this process) and its checks."""

from __future__ import annotations

from testbed.engine.results import EngineResult
from testbed.run.interface import REPLAY_VOCAB, EngineEntry, EngineRun
from testbed.run.options import RunOptions
from testbed.run.servable import engine_spec
from testbed.spec.runspec import RunSpec

VLLM_VOCAB = 1024
"""The tiny model's vocabulary."""
_CPU_BLOCK_MULTIPLE = 32  # vLLM's CPU attention backend


def check_spec(spec: RunSpec, options: RunOptions | None = None) -> None:
    """Refuses, before any work, what the vllm engine cannot run as asked."""
    problems = []
    if spec.metadata_only:
        problems.append(
            "metadata_only does not apply to the vllm engine (a real model needs the KV bytes); "
            "use the replay engine for metadata-only capacity sweeps"
        )
    if spec.model is None and spec.block_size % _CPU_BLOCK_MULTIPLE:
        problems.append(
            f"block_size {spec.block_size} is not a multiple of {_CPU_BLOCK_MULTIPLE}, which "
            "vLLM's CPU attention needs; use e.g. --block-size 32 or 64"
        )
    if spec.mla or spec.profile != "tiny":
        problems.append(
            "the vllm engine's KV shape is its model's: profile and mla apply to the replay "
            "engine (leave them at their defaults)"
        )
    if problems:
        raise ValueError("invalid run spec for the vllm engine: " + "; ".join(problems))


def bytes_per_token(spec: RunSpec) -> int:
    """KV bytes the cache stores per token of the spec's model, all TP ranks."""
    from testbed.engine.vllm_engine import tiny_bytes_per_token

    if spec.model is None:
        return tiny_bytes_per_token() * spec.tp
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(spec.model)
    heads = getattr(config, "num_key_value_heads", config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers * 2 * heads * head_dim * 2 * spec.tp  # bf16/fp16


def vocab_size(spec: RunSpec) -> int:
    """The tiny model's vocabulary, or (a named model) the workload generators' default."""
    return VLLM_VOCAB if spec.model is None else REPLAY_VOCAB


def run(job: EngineRun) -> EngineResult:
    """The full vLLM engine with the connector against the run's cache server."""
    from testbed.engine.vllm_engine import VllmEngine, VllmEngineSpec

    spec = engine_spec(VllmEngineSpec, job.spec, job.plan.requests)
    with VllmEngine(spec, job.endpoints[0], work_dir=job.run_dir) as engine:
        return engine.run(job.plan.requests, on_finish=job.progress.finished)


def vllm_kv_bytes(spec: RunSpec, blocks: int, bytes_per_token: int) -> int:
    """vLLM's KV cache (``kv_cache_memory_bytes``) on every TP rank."""
    return blocks * spec.block_size * bytes_per_token


ENTRY = EngineEntry(
    run=run,
    check=check_spec,
    bytes_per_token=bytes_per_token,
    vocab_size=vocab_size,
    model_name=lambda spec: spec.model or "tiny",
    engine_kv_bytes=vllm_kv_bytes,
)
