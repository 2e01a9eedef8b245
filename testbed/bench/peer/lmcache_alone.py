"""LMCache's server alone: its own client adapters, no vLLM engine, run by the peer's Python.

``python lmcache_alone.py --port P --layers L --heads H --head-dim D --block-size B``: the
scheduler and worker adapters LMCache's vLLM connector uses (``LMCacheMPSchedulerAdapter``,
``LMCacheMPWorkerAdapter``, worker-copies ``engine_driven`` mode) against the server on
127.0.0.1:P, with KV tensors in vLLM-CPU's layout (per layer ``[blocks, heads, block size,
2 x head dim]``, fp16). Each stdin line ``<index> <chunks>`` runs one cycle and answers (as
:mod:`engine_protocol` does) the seconds of a hit's lookup, of a store (submit until the
adapter reports it finished) and of a retrieve into other blocks (likewise), the same
operations :class:`testbed.bench.cache_driver.CacheDriver` times for ours.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

POLL_S = 0.0002


def main() -> int:
    parser = argparse.ArgumentParser(description="kvtb bench: LMCache alone (internal)")
    for name in ("--port", "--layers", "--heads", "--head-dim", "--block-size", "--max-chunks"):
        parser.add_argument(name, type=int, required=True)
    args = parser.parse_args()
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from engine_protocol import answer

    scheduler, worker = _adapters(args.port, args.block_size)
    _register_kv(worker, args)
    answer({"ready": True})
    for line in sys.stdin:
        index, chunks = (int(x) for x in line.split())
        answer(_cycle(scheduler, worker, index, chunks, args.block_size))
    worker.shutdown()
    scheduler.shutdown()
    return 0


def _adapters(port: int, block_size: int) -> tuple[Any, Any]:
    """LMCache's scheduler and worker adapters, ``engine_driven``, against 127.0.0.1:``port``."""
    import zmq
    from lmcache.integration.vllm.vllm_multi_process_adapter import (
        LMCacheMPSchedulerAdapter,
        LMCacheMPWorkerAdapter,
        ParallelStrategy,
    )

    url = f"tcp://127.0.0.1:{port}"
    config = {"lmcache.mp.mp_transfer_mode": "engine_driven", "lmcache.mp.mq_timeout": 30.0}
    strategy = ParallelStrategy(False, 1, 0, 1, 0, 1, 1)
    context: Any = zmq.Context.instance()
    scheduler = LMCacheMPSchedulerAdapter(
        [url], context, "bench", block_size, strategy, extra_config=config
    )
    worker = LMCacheMPWorkerAdapter(
        url, context, "bench", block_size, strategy, extra_config=config
    )
    return scheduler, worker


def _register_kv(worker: Any, args: argparse.Namespace) -> None:
    """Random fp16 KV in vLLM-CPU's layout, room for ``--max-chunks`` chunks twice over (a
    store's blocks and a retrieve's), registered with ``worker``."""
    import torch
    from engine_protocol import CHUNK
    from lmcache.integration.vllm.kv_cache_groups import create_engine_group_infos_from_vllm

    blocks_per_chunk = CHUNK // args.block_size
    num_blocks = 2 * args.max_chunks * blocks_per_chunk + 2
    shape = (args.layers, num_blocks, args.heads, args.block_size, 2 * args.head_dim)
    raw = torch.randint(-(1 << 15), 1 << 15, shape, dtype=torch.int16).view(torch.float16)
    kv_caches = {f"model.layers.{i}.self_attn.attn": raw[i] for i in range(args.layers)}
    groups = create_engine_group_infos_from_vllm(None, kv_caches, layout_hints={})
    worker.register_kv_caches(kv_caches, engine_group_infos=groups, layout_hints={})


def _cycle(scheduler: Any, worker: Any, index: int, chunks: int, block_size: int) -> dict[str, Any]:
    """One cycle of prompt ``index`` (``chunks`` chunks): a miss's lookup, a store, a hit's
    lookup and a retrieve into other blocks, timed; with the hit's tokens and load errors."""
    from engine_protocol import CHUNK
    from lmcache.integration.vllm.vllm_multi_process_adapter import LoadStoreOp

    n = chunks * CHUNK
    tokens = [(index * 7919 + 31 * i) % 30_000 for i in range(n + 1)]
    first = list(range(n // block_size))
    second = [b + len(first) + 1 for b in first]
    times: dict[str, Any] = {}
    times["miss_lookup_s"], _ = _lookup(scheduler, f"a{index}", tokens)
    started = time.perf_counter()
    worker.submit_store_request(f"a{index}", LoadStoreOp(tokens, [first], 0, n), None)
    _wait_finished(worker, f"a{index}", 0, {f"a{index}"})
    times["store_s"] = time.perf_counter() - started
    scheduler.end_session(f"a{index}")
    scheduler.cleanup_lookup_result(f"a{index}")
    times["lookup_s"], times["hit_tokens"] = _lookup(scheduler, f"b{index}", tokens)
    started = time.perf_counter()
    op = LoadStoreOp(tokens, [second], 0, times["hit_tokens"])
    worker.submit_retrieve_request(f"b{index}", op, None)
    _wait_finished(worker, f"b{index}", 1, set())
    times["retrieve_s"] = time.perf_counter() - started
    times["load_errors"] = len(worker.get_block_ids_with_load_errors())
    scheduler.end_session(f"b{index}")
    scheduler.cleanup_lookup_result(f"b{index}")
    return times


def _wait_finished(worker: Any, request_id: str, which: int, engine_finished: set[str]) -> None:
    """Polls ``worker`` until it reports ``request_id`` finished (``which``: 0 stores, 1
    retrieves)."""
    while True:
        done = worker.get_finished(engine_finished)[which] or set()
        if request_id in done:
            return
        time.sleep(POLL_S)


def _lookup(scheduler: Any, request_id: str, tokens: list[int]) -> tuple[float, int]:
    """Seconds from submitting a lookup of ``tokens`` to its answer, and the tokens it hit."""
    started = time.perf_counter()
    scheduler.maybe_submit_lookup_request(request_id, tokens)
    while (hit := scheduler.check_lookup_result(request_id)) is None:
        time.sleep(POLL_S)
    return time.perf_counter() - started, hit


if __name__ == "__main__":
    sys.exit(main())
