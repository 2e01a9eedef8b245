"""One TP rank of the replay engine: a model runner without a model.

It owns real paged KV tensors (one int16 tensor per layer, ``(num_blocks, block_size,
elements)``), the WORKER-role connector, and runs the connector hooks in the order vLLM's
model runner does for every step (``gpu_model_runner`` + ``kv_connector_model_runner_mixin``):

    handle_preemptions → zero new blocks → bind metadata → [start_load_kv if sync loads]
    → "forward": write deterministic KV for the scheduled tokens → [start_load_kv otherwise]
    → wait_for_save → get_transfer_results → get_block_ids_with_load_errors
    → get_kv_connector_stats → build_connector_worker_meta → clear metadata

Instead of attention it writes :mod:`testbed.engine.kv_content` values, and whenever a request
starts with tokens it did not compute (engine prefix-cache hit or external load) it checks
those tokens' KV bit for bit; every mismatching block is an integrity error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from connector.ops import FinishingOrder
from testbed.engine import kv_content
from testbed.models.profiles import KVProfile


@dataclass
class StepOutcome:
    """What one rank's step reports: its connector output as vLLM's runner would send it,
    and the integrity errors the harness found (engine-side verification, not accounting)."""

    finished_sending: set[str] = field(default_factory=FinishingOrder)
    finished_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)
    connector_stats: Any = None
    """The connector's ``KVConnectorStats`` of the step (``None``: nothing happened)."""
    worker_meta: Any = None
    """The connector's ``KVConnectorWorkerMetadata`` of the step (store reports)."""
    integrity_errors: int = 0


@dataclass
class _RequestKV:
    token_ids: np.ndarray
    hashes: np.ndarray
    block_ids: list[int] = field(default_factory=list)

    def extend(self, token: int) -> None:
        # H_p = r·H_{p-1} + t_p, continuing kv_content.prefix_hashes by one token.
        previous = self.hashes[-1] if len(self.hashes) else np.uint64(0)
        with np.errstate(over="ignore"):
            value = previous * kv_content._R + np.uint64(token + 1)
        self.token_ids = np.append(self.token_ids, np.int32(token))
        self.hashes = np.append(self.hashes, value)


class WorkerHarness:
    def __init__(
        self,
        connector,  # KVTBConnector in the WORKER role
        profile: KVProfile,
        *,
        tp: int,
        rank: int,
        num_blocks: int,
        block_size: int,
        write_kv: bool = True,
    ) -> None:
        self.connector = connector
        self.block_size = block_size
        self.write_kv = write_kv
        elements = profile.elements_per_token_layer(tp)
        self.layers = [
            torch.zeros((num_blocks, block_size, elements), dtype=torch.int16)
            for _ in range(profile.num_layers)
        ]
        self._constants = _rank_constants(profile, tp, rank)
        self._requests: dict[str, _RequestKV] = {}
        connector.register_kv_caches(
            {f"model.layers.{i}.self_attn.attn": layer for i, layer in enumerate(self.layers)}
        )
        # Only after registration: server-driven, it moves the tensors' bytes into shared
        # memory, and a numpy view made earlier would keep pointing at the old allocation.
        self._flat = [
            layer.view(num_blocks * block_size, elements).numpy() for layer in self.layers
        ]

    # -----------------------------------------------------------------------------------------

    def add_request(self, request_id: str, token_ids: np.ndarray) -> None:
        hashes = kv_content.prefix_hashes(token_ids) if self.write_kv else np.zeros(0, np.uint64)
        self._requests[request_id] = _RequestKV(token_ids, hashes)

    def append_output(self, request_id: str, token: int) -> None:
        state = self._requests.get(request_id)
        if state is not None and self.write_kv:
            state.extend(token)

    def execute(self, scheduler_output) -> StepOutcome:
        """Runs one engine step on this rank (see the module docstring for the order)."""
        so = scheduler_output
        connector = self.connector
        metadata = so.kv_connector_metadata
        for request_id in so.finished_req_ids:
            self._requests.pop(request_id, None)
        connector.handle_preemptions(metadata)
        if so.new_block_ids_to_zero and self.write_kv:
            self._zero(so.new_block_ids_to_zero)
        connector.bind_connector_metadata(metadata)
        if so.has_sync_kv_loads:
            connector.start_load_kv(None)
        starts, inherited = self._update_block_tables(so)
        if self.write_kv:
            self._forward(so, starts)
        if not so.has_sync_kv_loads:
            connector.start_load_kv(None)
        connector.wait_for_save()
        results = connector.get_transfer_results(so.finished_req_ids)
        outcome = StepOutcome(
            finished_sending=FinishingOrder(results.finished_sending or ()),
            finished_recving=set(results.finished_recving or ()),
            invalid_block_ids=set(connector.get_block_ids_with_load_errors()),
            connector_stats=connector.get_kv_connector_stats(),
            worker_meta=connector.build_connector_worker_meta(),
        )
        connector.clear_connector_metadata()
        if self.write_kv:
            outcome.integrity_errors = self._verify(inherited, starts, outcome.invalid_block_ids)
        return outcome

    def close(self) -> None:
        self.connector.shutdown()

    # -----------------------------------------------------------------------------------------

    def _update_block_tables(self, so) -> tuple[dict[str, tuple[int, int]], set[str]]:
        """Block tables after this step's allocations: per scheduled request ``(computed,
        scheduled)``, and the requests that start with ``computed`` tokens they did not compute
        themselves (new and resumed ones): those tokens are verified."""
        starts: dict[str, tuple[int, int]] = {}
        for new in so.scheduled_new_reqs:
            state = self._requests[new.req_id]
            state.block_ids = list(new.block_ids[0])
            starts[new.req_id] = (new.num_computed_tokens, so.num_scheduled_tokens[new.req_id])
        cached = so.scheduled_cached_reqs
        for index, request_id in enumerate(cached.req_ids):
            state = self._requests[request_id]
            new_blocks = cached.new_block_ids[index]
            if request_id in cached.resumed_req_ids:
                state.block_ids = list(new_blocks[0]) if new_blocks is not None else []
            elif new_blocks is not None:
                state.block_ids.extend(new_blocks[0])
            computed = cached.num_computed_tokens[index]
            starts[request_id] = (computed, so.num_scheduled_tokens[request_id])
        inherited = {new.req_id for new in so.scheduled_new_reqs} | set(cached.resumed_req_ids)
        return starts, inherited

    def _rows(self, state: _RequestKV, start: int, end: int) -> np.ndarray:
        positions = np.arange(start, end)
        blocks = np.asarray(state.block_ids, dtype=np.int64)[positions // self.block_size]
        return blocks * self.block_size + positions % self.block_size

    def _forward(self, so, starts: dict[str, tuple[int, int]]) -> None:
        for request_id, (computed, scheduled) in starts.items():
            state = self._requests[request_id]
            end = min(computed + scheduled, len(state.hashes))
            if end <= computed:
                continue
            rows = self._rows(state, computed, end)
            hashes = state.hashes[computed:end]
            for flat, constants in zip(self._flat, self._constants, strict=True):
                flat[rows] = kv_content.kv_values(hashes, constants)

    def _verify(
        self, inherited: set[str], starts: dict[str, tuple[int, int]], invalid_block_ids: set[int]
    ) -> int:
        errors = 0
        for request_id in inherited:
            computed, _ = starts[request_id]
            state = self._requests[request_id]
            # vLLM recomputes from the first block that failed to load: do not check past it.
            for index, block in enumerate(state.block_ids[: -(-computed // self.block_size)]):
                if block in invalid_block_ids:
                    computed = min(computed, index * self.block_size)
                    break
            if computed <= 0:
                continue
            rows = self._rows(state, 0, computed)
            hashes = state.hashes[:computed]
            bad = np.zeros(computed, dtype=bool)
            for flat, constants in zip(self._flat, self._constants, strict=True):
                bad |= (flat[rows] != kv_content.kv_values(hashes, constants)).any(axis=1)
            if bad.any():
                errors += len(np.unique(np.nonzero(bad)[0] // self.block_size))
        return errors

    def _zero(self, block_ids: list[int]) -> None:
        index = torch.tensor(block_ids, dtype=torch.long)
        for layer in self.layers:
            layer.index_fill_(0, index, 0)


def _rank_constants(profile: KVProfile, tp: int, rank: int) -> list[np.ndarray]:
    """Per layer, the content constants of the elements this rank holds (its heads' K and V,
    or the whole latent with MLA), cut from the full model's constants."""
    heads = profile.num_kv_heads
    dim = profile.head_dim
    full = kv_content.element_constants(profile.num_layers, profile.kv_factor * heads * dim)
    full = full.reshape(profile.num_layers, profile.kv_factor, heads, dim)
    per_rank = profile.heads_per_rank(tp)
    first = 0 if profile.mla else rank * per_rank
    mine = full[:, :, first : first + per_rank, :]
    return [np.ascontiguousarray(layer.reshape(-1)) for layer in mine]
