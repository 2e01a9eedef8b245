"""Whole cache operations against a real server, as the connector makes them, one rank.

A :class:`CacheDriver` holds the scheduler side and one worker client of our connector over
real ZeroMQ, with KV tensors of a named profile in vLLM's CPU layout, and times each
operation from the first message sent to the last reply handled (a store: plan, copy into the
pool, commit; a retrieve: plan, copy out of the pool, end). Runs in the bench process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from connector.kv_copy import PagedKV
from connector.planner import Geometry
from connector.scheduler import RequestView, ScheduledRequest, SchedulerSide
from connector.scheduler_client import SchedulerClient
from connector.worker_client import WorkerClient
from testbed.core.closing import Closing
from testbed.core.ranks import WorkerIdentity
from testbed.core.rpc import RpcClient
from testbed.models.profiles import KVProfile

BLOCK_SIZE = 32
"""vLLM's CPU default."""


def vllm_cpu_kv(profile: KVProfile, num_blocks: int, block_size: int) -> tuple[torch.Tensor, ...]:
    """Per-layer views of one fp16 allocation, as vLLM 0.32's CPU backend makes them."""
    heads, content = profile.num_kv_heads, 2 * profile.head_dim
    shape = (profile.num_layers, num_blocks, heads, block_size, content)
    raw = torch.randint(-(1 << 15), 1 << 15, shape, dtype=torch.int16)
    return tuple(raw.view(torch.float16)[layer] for layer in range(profile.num_layers))


@dataclass
class OpTimes:
    """Seconds of each operation of one cycle (``None``: not part of it)."""

    lookup: float = 0.0
    """A miss's lookup (the first pass's)."""
    store: float = 0.0
    end_session: float = 0.0
    lock_release: float | None = None
    retrieve: float = 0.0
    hit_lookup: float = 0.0
    """The second pass's lookup: a hit, its chunks locked."""


class CacheDriver(Closing):
    """Context manager: a scheduler side and a worker of one rank against ``url``."""

    def __init__(
        self,
        url: str,
        token: str,
        profile: KVProfile,
        *,
        chunk_size: int,
        num_chunks: int,
        model: str = "bench",
        transfer_mode: str = "worker",
    ) -> None:
        self.chunk_size = chunk_size
        self.blocks_per_chunk = chunk_size // BLOCK_SIZE
        num_blocks = 2 * num_chunks * self.blocks_per_chunk + 2
        self.rpc = RpcClient(url, token=token, role="scheduler", timeout_s=10.0)
        client = SchedulerClient(
            self.rpc, model=model, world_size=1, num_readers=1, chunk_size=chunk_size
        )
        self.side = SchedulerSide(
            client, Geometry(chunk_size, BLOCK_SIZE), engine_id="bench", lookup_wait_s=10.0
        )
        self.worker_rpc = RpcClient(url, token=token, role="worker0", timeout_s=10.0)
        identity = WorkerIdentity.for_rank(model, 1, 0, False, transfer_mode)
        self.worker = WorkerClient(self.worker_rpc, identity)
        self.kv = PagedKV(vllm_cpu_kv(profile, num_blocks, BLOCK_SIZE), 0, BLOCK_SIZE)
        self.worker.register(self.kv)
        self.num_chunks = num_chunks
        self.object_bytes = self.kv.layer_block_bytes * len(self.kv.layers) * self.blocks_per_chunk

    def cycle(self, index: int, *, engine_hit_chunks: int = 0) -> OpTimes:
        """A miss stored, then the same prompt again retrieved (into other blocks), with the
        first ``engine_hit_chunks`` chunks held by the engine (their locks are released)."""
        times = OpTimes()
        n = self.num_chunks * self.chunk_size
        tokens = [(index * 7919 + 31 * i) % 30_000 for i in range(n + 1)]
        first = list(range(n // BLOCK_SIZE + 1))
        second = [b + len(first) for b in first]
        started = time.perf_counter()
        self._lookup(f"a{index}", tokens, 0)
        times.lookup = time.perf_counter() - started
        self.side.update_state_after_alloc(f"a{index}", first, 0)
        plan = self.side.build_plan([ScheduledRequest(f"a{index}", 0, len(tokens), first, True)])
        started = time.perf_counter()
        if not self.worker.store(plan.stores):
            raise RuntimeError("a benchmark store failed")
        times.store = time.perf_counter() - started
        started = time.perf_counter()
        self.side.request_finished(f"a{index}")
        times.end_session = time.perf_counter() - started
        engine_hit = engine_hit_chunks * self.chunk_size
        started = time.perf_counter()
        loaded = self._lookup(f"b{index}", tokens, engine_hit)
        times.hit_lookup = time.perf_counter() - started
        started = time.perf_counter()
        self.side.update_state_after_alloc(f"b{index}", second, loaded)
        if engine_hit:
            times.lock_release = time.perf_counter() - started
        plan = self.side.build_plan([])
        started = time.perf_counter()
        self.worker.submit_retrieves(plan.retrieves)
        outcome = self.worker.complete_retrieves(wait_s=10.0)
        times.retrieve = time.perf_counter() - started
        if outcome.failed_block_ids or not outcome.finished:
            raise RuntimeError("a benchmark retrieve failed")
        self.side.request_finished(f"b{index}")
        return times

    def _lookup(self, request_id: str, tokens: list[int], engine_hit: int) -> int:
        view = RequestView(request_id, tokens, len(tokens), len(tokens))
        loaded, _ = self.side.get_num_new_matched_tokens(view, engine_hit)
        if loaded is None:
            raise RuntimeError("a benchmark lookup did not settle")
        return loaded

    def close(self) -> None:
        self.worker.close()
        self.worker_rpc.close()
        self.rpc.close()
        self.kv.close()
