"""The ``replay`` engine: vLLM's real v1 scheduler and our connector, no model.

Requests enter vLLM's ``Scheduler`` (prefix caching, chunked prefill, preemption, async KV
loads) as they arrive on a virtual clock; each step, one :class:`WorkerHarness` per TP rank
plays the model runner (connector hooks in vLLM's order, deterministic KV instead of a forward
pass, every inherited block verified), and the scheduler gets the ``ModelRunnerOutput`` the
real runner would build. The virtual clock advances by a documented time model per step
(``testbed.models.time_model``): by default a roofline of the named hardware (``h100``) for
the compute model of the run (the tokens each scheduled request computes, its context, the
tokens loaded from the cache), or the ``flat`` clock ``5 ms + 40 µs x scheduled tokens``; it
gives projected TTFTs, not measurements. Lookups and loads wait for the server's answers
(``kvtb.lookup_wait_s`` / ``kvtb.load_wait_s``), so a replay's hit rates do not depend on how
fast this machine happens to be.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs

from testbed.core.credentials import ServerEndpoint
from testbed.engine.instance import ReplayInstance
from testbed.engine.model_dir import TinyModel, write_model_dir
from testbed.engine.replay_spec import ReplaySpec
from testbed.engine.virtual_clock import ClockedEngine
from testbed.engine.vllm_setup import RequestFactory
from testbed.engine.worker_harness import StepOutcome
from testbed.workloads import WorkloadRequest

__all__ = ["ReplayEngine", "ReplaySpec"]


class ReplayEngine(ClockedEngine):
    """Context manager: one :class:`~testbed.engine.instance.ReplayInstance` (the scheduler
    and the TP worker harnesses) against ``server``, on the virtual clock.

    With ``server=None`` there is no connector and no worker: vLLM's scheduler alone, the
    baseline the replay's overhead is measured against. Engines drive; they do not count:
    what requests got from the caches is read from the run's telemetry afterwards. Finished
    loads go through vLLM's own ``KVOutputAggregator``, as the real executor does with its TP
    workers: a request's load is finished once every rank has reported it, in any steps.
    """

    name = "replay"

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
        self.instance = ReplayInstance(spec, server, model_dir)
        self.instances = [self.instance]
        self.requests = RequestFactory(self.instance.vllm_config, self.instance.kv_cache_config)

    @property
    def scheduler(self) -> Scheduler:
        return self.instance.scheduler

    def close(self) -> None:
        self.instance.close()
        if self._tmp is not None:
            self._tmp.cleanup()

    def submit(self, request: WorkloadRequest, traceparent: str = "") -> None:
        """Adds ``request`` to vLLM's scheduler and to every rank, as its arrival does (for
        callers that step the scheduler themselves)."""
        self.instance.add(request, self.requests.for_workload(request, traceparent))

    def execute(
        self, so: SchedulerOutput
    ) -> tuple[dict[int, EngineCoreOutputs], list[StepOutcome]]:
        """Runs one scheduled step on every rank and hands vLLM's scheduler what the model
        runner would (:meth:`ReplayInstance.execute`)."""
        return self.instance.execute(so)
