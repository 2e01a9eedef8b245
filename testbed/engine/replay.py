"""The ``replay`` engine: vLLM's real v1 scheduler and our connector, no model.

Requests enter vLLM's ``Scheduler`` (prefix caching, chunked prefill, preemption, async KV
loads) as they arrive on a virtual clock; each step, one :class:`WorkerHarness` per TP rank
plays the model runner (connector hooks in vLLM's order, deterministic KV instead of a forward
pass, every inherited block verified), and the scheduler gets the ``ModelRunnerOutput`` the
real runner would build. The virtual clock advances by a documented time model per step
(``testbed.engine.time_model``): by default a roofline of the named hardware (``h100``) for
the compute model of the run (the tokens each scheduled request computes, its context, the
tokens loaded from the cache), or the ``flat`` clock ``5 ms + 40 µs x scheduled tokens``; it
gives projected TTFTs, not measurements. Lookups and loads wait for the server's answers
(``kvtb.lookup_wait_s`` / ``kvtb.load_wait_s``), so a replay's hit rates do not depend on how
fast this machine happens to be.
"""

from __future__ import annotations

import itertools
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

from connector.config import ConnectorConfig
from connector.ops import FinishingOrder
from testbed import telemetry
from testbed.credentials import ServerEndpoint
from testbed.engine.model_dir import TinyModel, write_model_dir
from testbed.engine.profiles import KVProfile
from testbed.engine.results import EngineResult, RequestRecord, close_request, open_request
from testbed.engine.time_model import TimeModel, make_time_model
from testbed.engine.vllm_setup import (
    RequestFactory,
    SchedulerSpec,
    build_kv_cache_config,
    build_scheduler,
    build_vllm_config,
    build_worker_connector,
)
from testbed.engine.worker_harness import StepOutcome, WorkerHarness
from testbed.runspec import RunSpec
from testbed.workloads import ArrivalProcess, OpenLoop, WorkloadRequest

SAMPLED_TOKEN = 7  # never a stop token: hand-made sampling params have no EOS
_MAX_IDLE_STEPS = 100_000


@dataclass(frozen=True)
class ReplaySpec:
    profile: KVProfile
    chunk_size: int = 256
    tp: int = 1
    block_size: int = 64
    engine_blocks: int = 8192
    """vLLM's KV pool in blocks (small pools cause preemption)."""
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 64
    max_model_len: int = 8192
    load_async: bool = True
    prefix_caching: bool = True
    transfer_mode: str = "worker"
    store_wait: bool = True
    """Each step's stores commit before the step reports (``kvtb.store_wait_s``)."""
    arrival: str = "trace"
    """``trace``: requests enter as their arrival process releases them on the virtual clock
    (their times, or closed-loop users); ``all``: at once."""
    time_profile: str = "flat"
    """The projected clock's hardware (``testbed.engine.time_model``): flat, h100, ..."""
    compute_profile: KVProfile | None = None
    """The model the clock charges (``None``: ``profile``; it needs a compute shape unless
    the clock is flat)."""
    fault_drop_fraction: float = 0.0
    """Fault injection (the connector's ``kvtb.fault_drop_fraction``): share of retrieves
    whose first chunk is dropped from the server just before the retrieve."""
    seed: int = 0
    metadata_only: bool = False
    timeout_s: float = 30.0
    run_id: str = "replay"

    def __post_init__(self) -> None:
        if self.arrival not in ("trace", "all"):
            raise ValueError(f"arrival must be 'trace' or 'all', got {self.arrival!r}")
        if self.chunk_size % self.block_size:
            raise ValueError(
                f"chunk size {self.chunk_size} must be a multiple of the block size "
                f"{self.block_size}"
            )
        if not 0.0 <= self.fault_drop_fraction <= 1.0:
            raise ValueError("fault_drop_fraction must be in [0, 1]")
        self.profile.heads_per_rank(self.tp)  # raises if TP cannot split the heads

    @classmethod
    def from_run_spec(cls, spec: RunSpec, max_model_len: int) -> ReplaySpec:
        return cls(
            profile=spec.kv_profile,
            chunk_size=spec.chunk_size,
            tp=spec.tp,
            block_size=spec.block_size,
            engine_blocks=spec.engine_blocks,
            max_num_batched_tokens=spec.max_num_batched_tokens,
            max_num_seqs=spec.max_num_seqs,
            max_model_len=max_model_len,
            load_async=spec.load_async,
            prefix_caching=spec.prefix_caching,
            transfer_mode=spec.transfer_mode,
            store_wait=spec.store_wait,
            arrival=spec.arrival,
            fault_drop_fraction=spec.fault_drop_fraction,
            seed=spec.seed,
            metadata_only=spec.metadata_only,
            timeout_s=spec.server_timeout_s,
            time_profile=spec.time_profile,
            compute_profile=spec.compute_profile,
            run_id=spec.run_id,
        )

    def time_model(self) -> TimeModel:
        return make_time_model(
            self.time_profile,
            self.compute_profile or self.profile,
            tp=self.tp,
            chunk_size=self.chunk_size,
        )


class ReplayEngine:
    """Context manager: builds the scheduler and the TP worker harnesses against ``server``.

    With ``server=None`` there is no connector and no worker: vLLM's scheduler alone, the
    baseline the replay's overhead is measured against. Engines drive; they do not count:
    what requests got from the caches is read from the run's telemetry afterwards. Finished
    loads go through vLLM's own ``KVOutputAggregator``, as the real executor does with its TP
    workers: a request's load is finished once every rank has reported it, in any steps.
    """

    def __init__(
        self, spec: ReplaySpec, server: ServerEndpoint | None, work_dir: Path | None = None
    ) -> None:
        self.spec = spec
        self._tmp = None if work_dir else tempfile.TemporaryDirectory(prefix="kvtb-model-")
        base_dir = work_dir if work_dir is not None else Path(self._tmp.name)  # type: ignore[union-attr]
        model_dir = write_model_dir(
            base_dir / "model",
            TinyModel(max_position_embeddings=spec.max_model_len),
        )
        connector = ConnectorConfig(
            server_url=server.url if server else "tcp://127.0.0.1:5555",
            token=server.token if server else "",
            mq_timeout_s=spec.timeout_s,
            chunk_size=spec.chunk_size,
            model_name=f"replay-{spec.profile.name}",
            mla=spec.profile.mla,
            load_async=spec.load_async,
            lookup_wait_s=spec.timeout_s,
            load_wait_s=spec.timeout_s,
            store_wait_s=spec.timeout_s if spec.store_wait else 0.0,
            transfer_mode=spec.transfer_mode,
            engine_id=spec.run_id,
            fault_drop_fraction=spec.fault_drop_fraction if server else 0.0,
            fault_seed=spec.seed,
            admin_token=server.admin_token if server and spec.fault_drop_fraction else "",
        )
        self.vllm_config = build_vllm_config(
            SchedulerSpec(
                model_dir=model_dir,
                block_size=spec.block_size,
                num_blocks=spec.engine_blocks,
                max_num_batched_tokens=spec.max_num_batched_tokens,
                max_num_seqs=spec.max_num_seqs,
                max_model_len=spec.max_model_len,
                connector_config=connector.to_extra_config() if server else None,
                tp_size=spec.tp,
                prefix_caching=spec.prefix_caching,
            )
        )
        kv_cache_config = build_kv_cache_config(self.vllm_config, spec.engine_blocks)
        self.scheduler = build_scheduler(self.vllm_config, kv_cache_config)
        self.requests = RequestFactory(self.vllm_config, kv_cache_config)
        self.workers = [
            WorkerHarness(
                build_worker_connector(self.vllm_config, kv_cache_config, rank),
                spec.profile,
                tp=spec.tp,
                rank=rank,
                num_blocks=spec.engine_blocks,
                block_size=spec.block_size,
                write_kv=not spec.metadata_only,
            )
            for rank in range(spec.tp if server else 0)
        ]
        self.aggregator = KVOutputAggregator(expected_finished_count=max(1, len(self.workers)))
        self._send_order: dict[str, int] = {}  # request id -> when a rank first reported it
        self._send_sequence = itertools.count()
        self.clock = spec.time_model()

    def close(self) -> None:
        for worker in self.workers:
            worker.close()
        self.scheduler.shutdown()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> ReplayEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -----------------------------------------------------------------------------------------

    def run(
        self,
        workload: Iterable[WorkloadRequest] | ArrivalProcess[WorkloadRequest],
        on_finish: Callable[[RequestRecord], None] | None = None,
    ) -> EngineResult:
        """Replays ``workload``: requests in arrival order, or an arrival process (closed-loop
        users) that is told, on the virtual clock, when each request finished."""
        spec = self.spec
        result = EngineResult(engine="replay", metadata_only=spec.metadata_only)
        records: dict[str, RequestRecord] = {}
        spans: dict[str, telemetry.Span] = {}
        arrivals = workload if isinstance(workload, ArrivalProcess) else OpenLoop(workload)
        clock = 0.0
        idle_steps = 0
        started = time.perf_counter()
        while True:
            for request in arrivals.release(clock if spec.arrival == "trace" else float("inf")):
                if not self._add(request, records, spans, result, clock):
                    arrivals.complete(request.request_id, clock)
            if not self.scheduler.has_requests():
                upcoming = arrivals.next_arrival_s()
                if upcoming is None:
                    if arrivals.waiting():
                        raise RuntimeError(
                            f"{arrivals.waiting()} requests wait for completions the replay "
                            "never reported"
                        )
                    break
                clock = max(clock, upcoming)
                continue
            step_started = time.perf_counter()
            so = self.scheduler.schedule()
            outcomes = [worker.execute(so) for worker in self.workers]
            result.integrity_errors += sum(o.integrity_errors for o in outcomes)
            engine_outputs = self.scheduler.update_from_output(
                so, self._runner_output(so, outcomes)
            )
            result.max_step_s = max(result.max_step_s, time.perf_counter() - step_started)
            clock += self._step_s(so)
            result.steps += 1
            idle_steps = 0 if so.total_num_scheduled_tokens else idle_steps + 1
            if idle_steps > _MAX_IDLE_STEPS:
                raise RuntimeError(
                    f"the replay made no progress for {idle_steps} steps with "
                    f"{len(self.scheduler.requests)} requests left; is a load never finishing?"
                )
            for output in engine_outputs[0].outputs if engine_outputs else []:
                record = records[output.request_id]
                for token in output.new_token_ids:
                    for worker in self.workers:
                        worker.append_output(output.request_id, token)
                if output.new_token_ids and record.first_token_s is None:
                    record.first_token_s = clock
                record.output_tokens += len(output.new_token_ids)
                if output.finish_reason is not None:
                    record.finish_s = clock
                    close_request(record, spans.pop(output.request_id))
                    result.records.append(record)
                    arrivals.complete(output.request_id, clock)
                    if on_finish is not None:
                        on_finish(record)
        result.wall_s = time.perf_counter() - started
        result.virtual_s = clock
        return result

    def _add(
        self,
        request: WorkloadRequest,
        records: dict[str, RequestRecord],
        spans: dict[str, telemetry.Span],
        result: EngineResult,
        clock: float,
    ) -> bool:
        """Adds ``request`` to the scheduler; ``False`` when the engine can never serve it."""
        spec = self.spec
        prompt = request.prompt_token_ids
        total_tokens = len(prompt) + request.max_output_tokens
        needed_blocks = -(-total_tokens // spec.block_size)
        if total_tokens > spec.max_model_len or needed_blocks > spec.engine_blocks - 1:
            result.rejected.append(request.request_id)
            return False
        record, span = open_request(request, clock if spec.arrival == "all" else request.arrival_s)
        records[request.request_id] = record
        spans[request.request_id] = span
        for worker in self.workers:
            worker.add_request(request.request_id, prompt)
        self.scheduler.add_request(
            self.requests.make(
                request.request_id,
                prompt.tolist(),
                request.max_output_tokens,
                traceparent=telemetry.traceparent_of(span),
            )
        )
        return True

    def _step_s(self, so) -> float:
        """The step's projected time: per scheduled request its new and context tokens, per
        request loading this step the tokens it loads."""
        new, context, loaded = [], [], []
        loads: dict[str, int] = {}
        metadata = so.kv_connector_metadata
        for op in metadata.plan.retrieves if metadata is not None else ():
            tokens = op.end_token - op.start_token - op.skip_first_n_tokens
            loads[op.request_id] = loads.get(op.request_id, 0) + tokens
        for req in so.scheduled_new_reqs:
            new.append(so.num_scheduled_tokens[req.req_id])
            context.append(req.num_computed_tokens)
            loaded.append(loads.pop(req.req_id, 0))
        cached = so.scheduled_cached_reqs
        for index, request_id in enumerate(cached.req_ids):
            new.append(so.num_scheduled_tokens[request_id])
            context.append(cached.num_computed_tokens[index])
            loaded.append(loads.pop(request_id, 0))
        for tokens in loads.values():  # asynchronous loads of requests not scheduled yet
            new.append(0)
            context.append(0)
            loaded.append(tokens)
        return self.clock.step_s(new, context, loaded)

    def _runner_output(self, so, outcomes: list[StepOutcome]) -> ModelRunnerOutput:
        """What the executor hands the scheduler: rank 0's output with every rank's connector
        output aggregated by vLLM's own ``KVOutputAggregator``."""
        request_ids = list(so.num_scheduled_tokens)
        sampled = []
        for request_id in request_ids:
            request = self.scheduler.requests[request_id]
            done = request.num_computed_tokens >= request.num_tokens
            sampled.append([SAMPLED_TOKEN] if done else [])

        def output(outcome: StepOutcome | None) -> ModelRunnerOutput:
            connector_output = None
            if outcome is not None:
                connector_output = KVConnectorOutput(
                    finished_sending=outcome.finished_sending or None,
                    finished_recving=outcome.finished_recving or None,
                    invalid_block_ids=outcome.invalid_block_ids,
                )
            return ModelRunnerOutput(
                req_ids=request_ids,
                req_id_to_index={r: i for i, r in enumerate(request_ids)},
                sampled_token_ids=sampled,
                kv_connector_output=connector_output,
            )

        if not outcomes:
            return output(None)
        for outcome in outcomes:  # rank order, each rank's in its finishing order
            for request_id in outcome.finished_sending:
                if request_id not in self._send_order:
                    self._send_order[request_id] = next(self._send_sequence)
        aggregated = self.aggregator.aggregate([output(outcome) for outcome in outcomes])
        assert aggregated is not None
        kv = aggregated.kv_connector_output
        if kv is not None and kv.finished_sending:
            # The aggregator counts ranks in a plain set; vLLM frees blocks in the order it
            # iterates it, so it gets the ranks' finishing order back, as a one-rank engine.
            order = self._send_order
            kv.finished_sending = FinishingOrder(sorted(kv.finished_sending, key=order.__getitem__))
            for request_id in kv.finished_sending:
                del order[request_id]
        return aggregated
