"""One replay instance: vLLM's real v1 scheduler, its TP worker harnesses, their connector and
the step clock of the time model. The replay engine drives one; a fleet drives N on one
virtual clock (:mod:`testbed.engine.virtual_clock`).

An instance does not know the time: :meth:`ReplayInstance.step` runs one scheduler step (the
scheduler plans, every rank's harness plays the model runner, the scheduler takes the
aggregated output) and returns what the step did and how long the time model says it lasted;
whoever drives the instance stamps the outputs. Between steps the scheduler's state is
settled, so :meth:`cached_prefix_blocks` reads vLLM's prefix cache exactly as a request
arriving then would find it, and :meth:`take_kv_events` hands out the KV events vLLM's
scheduler published during the step (``kv_events=True``; see :mod:`testbed.fleet.kv_events`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

from connector.ops import FinishingOrder
from testbed.core.closing import Closing
from testbed.core.credentials import ServerEndpoint
from testbed.engine.engine_spec import connector_config
from testbed.engine.vllm_setup import (
    SchedulerSpec,
    build_kv_cache_config,
    build_scheduler,
    build_vllm_config,
    build_worker_connector,
)
from testbed.engine.worker_harness import StepOutcome, WorkerHarness
from testbed.workloads import WorkloadRequest

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from testbed.engine.replay_spec import ReplaySpec

SAMPLED_TOKEN = 7  # never a stop token: hand-made sampling params have no EOS


@dataclass
class StepReport:
    """What one scheduler step of an instance did (the driver stamps it with its time)."""

    duration_s: float
    """The step's projected time (the time model's)."""
    scheduled_tokens: int
    first_scheduled: list[str] = field(default_factory=list)
    """Requests scheduled for the first time this step (their queueing ends)."""
    new_tokens: dict[str, list[int]] = field(default_factory=dict)
    """Tokens each request generated this step."""
    finished: list[str] = field(default_factory=list)
    integrity_errors: int = 0
    wall_s: float = 0.0


class ReplayInstance(Closing):
    """One vLLM instance without a model, against ``server`` (``None``: no connector, no
    worker: vLLM's scheduler alone). ``engine_id`` names its connector sessions
    (``"{engine_id}:{request_id}"``). Context manager."""

    def __init__(
        self,
        spec: ReplaySpec,
        server: ServerEndpoint | None,
        model_dir: Path,
        *,
        engine_id: str | None = None,
        kv_events: bool = False,
    ) -> None:
        self.spec = spec
        run = spec.run
        connector = None
        if server is not None:
            connector = connector_config(
                run,
                server,
                engine_id=engine_id or spec.connector_engine_id,
                model_name=f"replay-{spec.profile.name}",
                mla=spec.profile.mla,
            ).to_extra_config()
        self.vllm_config = build_vllm_config(
            SchedulerSpec(
                model_dir=model_dir,
                run=run,
                num_blocks=spec.engine_blocks,
                max_model_len=spec.max_model_len,
                connector_config=connector,
                kv_events=kv_events or spec.kv_events,
            )
        )
        self.kv_cache_config = build_kv_cache_config(self.vllm_config, spec.engine_blocks)
        self.scheduler = build_scheduler(
            self.vllm_config, self.kv_cache_config, log_stats=spec.log_stats
        )
        self._events = None
        if kv_events:
            from testbed.fleet.kv_events import InProcessPublisher

            self._events = InProcessPublisher.install(self.scheduler)
        self.workers = [
            WorkerHarness(
                build_worker_connector(self.vllm_config, self.kv_cache_config, rank),
                spec.profile,
                tp=run.tp,
                rank=rank,
                num_blocks=spec.engine_blocks,
                block_size=run.block_size,
                write_kv=not run.metadata_only,
            )
            for rank in range(run.tp if server else 0)
        ]
        self.aggregator = KVOutputAggregator(expected_finished_count=max(1, len(self.workers)))
        self._send_order: dict[str, int] = {}  # request id -> when a rank first reported it
        self._send_sequence = itertools.count()
        self.clock = spec.time_model()

    def close(self) -> None:
        for worker in self.workers:
            worker.close()
        self.scheduler.shutdown()

    # -----------------------------------------------------------------------------------------

    def fits(self, request: WorkloadRequest) -> bool:
        """Whether the instance can ever serve ``request`` (model length, KV pool)."""
        spec = self.spec
        total_tokens = len(request.prompt_token_ids) + request.max_output_tokens
        needed_blocks = -(-total_tokens // spec.run.block_size)
        return total_tokens <= spec.max_model_len and needed_blocks <= spec.engine_blocks - 1

    def add(self, request: WorkloadRequest, vllm_request: Request) -> None:
        """Hands ``request`` (as vLLM's ``Request``) to the scheduler and the workers."""
        for worker in self.workers:
            worker.add_request(request.request_id, request.prompt_token_ids)
        self.scheduler.add_request(vllm_request)

    def has_requests(self) -> bool:
        return bool(self.scheduler.has_requests())

    def step(self) -> StepReport:
        """Runs one scheduler step (see the module docstring)."""
        started = time.perf_counter()
        so = self.scheduler.schedule()
        engine_outputs, outcomes = self.execute(so)
        report = StepReport(
            duration_s=self._step_s(so),
            scheduled_tokens=so.total_num_scheduled_tokens,
            first_scheduled=[new.req_id for new in so.scheduled_new_reqs],
            integrity_errors=sum(o.integrity_errors for o in outcomes),
        )
        for output in engine_outputs[0].outputs if engine_outputs else []:
            report.new_tokens[output.request_id] = list(output.new_token_ids)
            if output.finish_reason is not None:
                report.finished.append(output.request_id)
        report.wall_s = time.perf_counter() - started
        return report

    def execute(
        self, so: SchedulerOutput
    ) -> tuple[dict[int, EngineCoreOutputs], list[StepOutcome]]:
        """Runs one scheduled step on every rank, hands vLLM's scheduler what the model runner
        would and the ranks the sampled tokens; returns the scheduler's outputs (per client)
        and each rank's outcome."""
        outcomes = [worker.execute(so) for worker in self.workers]
        engine_outputs = self.scheduler.update_from_output(so, self._runner_output(so, outcomes))
        for output in engine_outputs[0].outputs if engine_outputs else []:
            for token in output.new_token_ids:
                for worker in self.workers:
                    worker.append_output(output.request_id, token)
        return engine_outputs, outcomes

    def cached_prefix_blocks(self, block_hashes: Sequence[Any]) -> int:
        """How many leading blocks of ``block_hashes`` (a vLLM request's) vLLM's prefix cache
        holds now: what a request with them admitted now would find (before vLLM caps the hit
        at the prompt's last token). Reads the block pool; changes nothing."""
        pool = self.scheduler.kv_cache_manager.block_pool
        held = 0
        for block_hash in block_hashes:
            if pool.get_cached_block(block_hash, [0]) is None:
                break
            held += 1
        return held

    def take_kv_events(self) -> list[Any]:
        """The KV events vLLM's scheduler published since the last call (``kv_events``)."""
        return self._events.drain() if self._events is not None else []

    # -----------------------------------------------------------------------------------------

    def _step_s(self, so: Any) -> float:
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

    def _runner_output(self, so: Any, outcomes: list[StepOutcome]) -> ModelRunnerOutput:
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
                    kv_connector_stats=outcome.connector_stats,
                    kv_connector_worker_meta=outcome.worker_meta,
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
