"""Drives the connector against a real server the way vLLM would, for one or more TP ranks.

A :class:`Harness` owns a scheduler side and one worker client per rank, each with its own
seeded paged KV tensors, all talking to the server over real ZeroMQ. Its methods run the
hook sequences vLLM runs for a request (lookup → allocate → plan → store / retrieve → finish)
so tests state scenarios, not plumbing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from connector.kv_copy import PagedKV
from connector.mirror import LookupMirror
from connector.ops import StepPlan
from connector.planner import Geometry
from connector.scheduler import RequestView, ScheduledRequest, SchedulerSide
from connector.scheduler_client import SchedulerClient
from connector.worker_client import RetrieveOutcome, WorkerClient
from testbed.core import protocol as p
from testbed.core.closing import Closing
from testbed.core.ranks import WorkerIdentity, kv_world_size, readers_per_object
from testbed.core.rpc import RpcClient

BLOCK_SIZE = 16


@dataclass
class Rank:
    rpc: RpcClient
    kv: PagedKV
    client: WorkerClient


class ServerLike(Protocol):
    url: str
    token: str
    admin_token: str


def connect(server: ServerLike, *, admin: bool = False, **kwargs: Any) -> RpcClient:
    """An RPC client of ``server`` holding its client (or admin) token."""
    token = server.admin_token if admin else server.token
    return RpcClient(server.url, token=token, **kwargs)


class Harness(Closing):
    def __init__(
        self,
        server: ServerLike,
        *,
        chunk_size: int = 64,
        tp: int = 1,
        mla: bool = False,
        model: str = "tiny",
        num_blocks: int = 128,
        num_layers: int = 2,
        seed: int = 0,
        timeout_s: float = 2.0,
        engine_id: str = "engine",
        transfer_mode: str = "worker",
        mirror: bool = False,
    ) -> None:
        self.chunk_size = chunk_size
        self.server = server
        self.rpc = connect(server, role="scheduler", timeout_s=timeout_s)
        self.rpc.call(p.GetConfig())  # as the connector asks at start (its epoch, its feed)
        self.client = SchedulerClient(
            self.rpc,
            model=model,
            world_size=kv_world_size(tp, mla),
            num_readers=readers_per_object(tp, mla),
            chunk_size=chunk_size,
            mirror=LookupMirror(num_writers=kv_world_size(tp, mla)) if mirror else None,
        )
        self.side = SchedulerSide(
            self.client,
            Geometry(chunk_size, BLOCK_SIZE),
            engine_id=engine_id,
            lookup_wait_s=timeout_s,
        )
        generator = torch.Generator().manual_seed(seed)
        self.ranks: list[Rank] = []
        for rank in range(tp):
            layers = tuple(
                torch.randn(
                    num_blocks, 2, BLOCK_SIZE, 1 if mla else 2, 8, generator=generator
                ).half()
                for _ in range(num_layers)
            )
            rpc = connect(server, role=f"worker{rank}", timeout_s=timeout_s)
            worker = WorkerClient(rpc, WorkerIdentity.for_rank(model, tp, rank, mla, transfer_mode))
            kv = PagedKV(layers, 0, BLOCK_SIZE)
            worker.register(kv)
            worker.report_chunks = mirror  # the reports vLLM's worker metadata carries
            self.ranks.append(Rank(rpc, kv, worker))

    # --- what vLLM does, step by step ---------------------------------------------------------

    def matched(
        self,
        request_id: str,
        tokens: list[int],
        engine_hit: int = 0,
        salt: str = "",
        traceparent: str = "",
    ) -> int:
        """``get_num_new_matched_tokens``: tokens the cache adds beyond ``engine_hit``."""
        view = RequestView(
            request_id, tokens, len(tokens), len(tokens), cache_salt=salt, traceparent=traceparent
        )
        loaded, _ = self.side.get_num_new_matched_tokens(view, engine_hit)
        assert loaded is not None, "lookup did not settle"
        return loaded

    def allocate(self, request_id: str, block_ids: list[int], num_external: int) -> StepPlan:
        """``update_state_after_alloc`` then the step's plan (with no scheduled tokens)."""
        self.side.update_state_after_alloc(request_id, block_ids, num_external)
        return self.side.build_plan([])

    def compute(
        self,
        request_id: str,
        computed_before: int,
        num_scheduled: int,
        block_ids: list[int],
        first: bool,
    ) -> StepPlan:
        """One scheduled step of the request: the plan it produces."""
        return self.side.build_plan(
            [ScheduledRequest(request_id, computed_before, num_scheduled, block_ids, first)]
        )

    def store(self, plan: StepPlan) -> None:
        for rank in self.ranks:
            rank.client.store(plan.stores)
            if self.client.mirror is not None:  # update_connector_output's part
                self.client.mirror.reported(rank.client.take_chunk_reports())

    def load(self, plan: StepPlan) -> list[RetrieveOutcome]:
        outcomes = []
        for rank in self.ranks:
            rank.client.submit_retrieves(plan.retrieves)
            outcomes.append(rank.client.complete_retrieves(wait_s=5.0))
        return outcomes

    def prefill(
        self,
        request_id: str,
        tokens: list[int],
        block_ids: list[int],
        salt: str = "",
        traceparent: str = "",
    ) -> StepPlan:
        """A whole request without cache hits: lookup, compute every token, store, finish."""
        self.matched(request_id, tokens, salt=salt, traceparent=traceparent)
        self.side.update_state_after_alloc(request_id, block_ids, 0)
        plan = self.compute(request_id, 0, len(tokens), block_ids, True)
        self.store(plan)
        self.side.request_finished(request_id)
        return plan

    def stats(self) -> p.ServerStats:
        stats = self.rpc.call(p.GetStats())
        assert isinstance(stats, p.ServerStats)
        return stats

    def close(self) -> None:
        for rank in self.ranks:
            rank.client.close()
            rank.rpc.close()
        self.rpc.close()


def blocks_equal(kv: PagedKV, a: list[int], b: list[int]) -> bool:
    """Whether blocks ``a`` hold exactly the bytes of blocks ``b`` in every layer."""
    ia, ib = torch.tensor(a), torch.tensor(b)
    return all(
        torch.equal(layer.index_select(kv.block_dim, ia), layer.index_select(kv.block_dim, ib))
        for layer in kv.layers
    )


def hit_and_load(h: Harness, session: str, tokens: list[int], target: list[int]) -> int:
    """A request whose lookup hits, loads into blocks ``target`` with no block failed and then
    finishes; the tokens loaded."""
    loaded = h.matched(session, tokens)
    outcomes = h.load(h.allocate(session, target, loaded))
    h.side.request_finished(session)
    assert [o.failed_block_ids for o in outcomes] == [set()]
    return loaded


def cache_cycle(h: Harness, chunk_size: int, traceparent: str = "") -> dict[str, object]:
    """One of every operation: a miss and its store, then a partial engine hit whose locks
    below the engine's boundary are freed, a retrieve of the rest, and the end of the session.
    Returns what an observer would compare between two runs of it."""
    tokens = [(31 * i + 5) % 30_000 for i in range(3 * chunk_size + 7)]
    h.prefill(
        "cycle-a", tokens, list(range(0, 3 * chunk_size // BLOCK_SIZE + 1)), traceparent=traceparent
    )
    engine_hit = chunk_size + BLOCK_SIZE
    loaded = h.matched("cycle-b", tokens, engine_hit=engine_hit, traceparent=traceparent)
    target = list(range(60, 60 + 3 * chunk_size // BLOCK_SIZE + 1))
    plan = h.allocate("cycle-b", target, loaded)
    outcomes = h.load(plan)
    h.side.request_finished("cycle-b")
    stats = h.stats()
    return {
        "loaded": loaded,
        "failed": sorted(b for o in outcomes for b in o.failed_block_ids),
        "restored": blocks_equal(h.ranks[0].kv, list(range(5, 12)), target[5:12]),
        "objects": stats.num_objects,
        "stored_bytes": stats.stored_bytes,
        "retrieved_bytes": stats.retrieved_bytes,
        "locks": stats.num_locks,
    }
