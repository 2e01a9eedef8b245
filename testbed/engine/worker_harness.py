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
    """A request's tokens' KV codes (``kv_content.layer_codes``), prompt and generated, in a
    buffer that grows by doubling."""

    codes: np.ndarray
    """uint16 ``(capacity, layers)``; the first ``length`` rows are the request's."""
    length: int
    last_hash: int
    """``H_p`` of the last token (0 before any)."""
    block_ids: list[int] = field(default_factory=list)

    def extend(self, token: int) -> None:
        self.last_hash = kv_content.next_hash(self.last_hash, token)
        if self.length == len(self.codes):
            grown = np.empty((max(16, 2 * len(self.codes)), self.codes.shape[1]), np.uint16)
            grown[: self.length] = self.codes[: self.length]
            self.codes = grown
        self.codes[self.length] = kv_content.layer_codes_of(self.last_hash, self.codes.shape[1])
        self.length += 1


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
        self._num_layers = profile.num_layers
        self._constants = _rank_constants(profile, tp, rank)
        self._requests: dict[str, _RequestKV] = {}
        self._offsets = np.arange(block_size, dtype=np.int64)
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
        if not self.write_kv:
            state = _RequestKV(np.zeros((0, self._num_layers), np.uint16), 0, 0)
        else:
            hashes = kv_content.prefix_hashes(np.asarray(token_ids))
            codes = kv_content.layer_codes(hashes, self._num_layers)
            last = int(hashes[-1]) if len(hashes) else 0
            state = _RequestKV(codes, len(codes), last)
        self._requests[request_id] = state

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
        """Rows of the flat KV (block x block size + offset) of positions ``[start, end)``."""
        size = self.block_size
        first, last = start // size, (end - 1) // size
        blocks = np.asarray(state.block_ids[first : last + 1], dtype=np.int64)
        rows = (blocks[:, None] * size + self._offsets[None, :]).reshape(-1)
        return rows[start - first * size : end - first * size]

    def _forward(self, so, starts: dict[str, tuple[int, int]]) -> None:
        """Writes the step's computed tokens' KV: every request's rows gathered, then one
        broadcast per layer."""
        rows, codes = [], []
        for request_id, (computed, scheduled) in starts.items():
            state = self._requests[request_id]
            end = min(computed + scheduled, state.length)
            if end > computed:
                rows.append(self._rows(state, computed, end))
                codes.append(state.codes[computed:end])
        if not rows:
            return
        all_rows, all_codes = np.concatenate(rows), np.concatenate(codes)
        for layer, (flat, constants) in enumerate(zip(self._flat, self._constants, strict=True)):
            flat[all_rows] = kv_content.kv_values(all_codes[:, layer], constants)

    def _verify(
        self, inherited: set[str], starts: dict[str, tuple[int, int]], invalid_block_ids: set[int]
    ) -> int:
        """Integrity errors: blocks of inherited tokens whose KV is not what this engine would
        have computed (every request's rows checked together, one comparison per layer)."""
        rows, codes, blocks = [], [], []
        numbered = 0  # each request's blocks get their own numbers
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
            rows.append(self._rows(state, 0, computed))
            codes.append(state.codes[:computed])
            blocks.append(numbered + np.arange(computed) // self.block_size)
            numbered += -(-computed // self.block_size)
        if not rows:
            return 0
        all_rows, all_codes = np.concatenate(rows), np.concatenate(codes)
        bad = np.zeros(len(all_rows), dtype=bool)
        for layer, (flat, constants) in enumerate(zip(self._flat, self._constants, strict=True)):
            expected = kv_content.kv_values(all_codes[:, layer], constants)
            bad |= (flat[all_rows] != expected).any(axis=1)
        return len(np.unique(np.concatenate(blocks)[bad]))

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
