"""The ``fleet`` engine: N replay instances behind a router, on one virtual clock.

Each instance is what the replay engine runs (:class:`~testbed.engine.instance.ReplayInstance`:
vLLM's real v1 scheduler with its own prefix cache, the TP worker harnesses, the connector,
the time model's step clock), built from the same :class:`~testbed.engine.replay.ReplaySpec`;
every replay option applies to each. Instances share one cache server or use one each
(``servers``: the run starts them); their connector sessions are
``"{run_id}-{instance}:{request_id}"``. One :class:`~testbed.engine.virtual_clock.VirtualClock`
drives them all: arrivals at the workload's times (or closed-loop users, told of completions on
whichever instance served them), each instance's steps lasting what the time model projects,
instances stepped in virtual-time order. The router (:mod:`testbed.fleet.routers`) decides
each arrival's instance; :mod:`testbed.engine.placement` records the decision. With one
instance the fleet is the replay engine, request by request.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

from testbed.core import telemetry
from testbed.core.credentials import ServerEndpoint
from testbed.engine.instance import ReplayInstance
from testbed.engine.model_dir import TinyModel, write_model_dir
from testbed.engine.placement import FleetPlacement
from testbed.engine.replay_spec import ReplaySpec
from testbed.engine.virtual_clock import ClockedEngine
from testbed.engine.vllm_setup import RequestFactory
from testbed.fleet.routers import Router


def instance_engine_id(run_id: str, instance: int) -> str:
    """The connector's engine id (session namespace) of fleet instance ``instance``."""
    return f"{run_id}-{instance}"


class FleetEngine(ClockedEngine):
    """Context manager: ``num_instances`` instances against ``servers`` (one shared, or one
    per instance) routed by ``router``."""

    name = "fleet"

    def __init__(
        self,
        spec: ReplaySpec,
        router: Router,
        servers: Sequence[ServerEndpoint],
        num_instances: int,
        work_dir: Path | None = None,
    ) -> None:
        if len(servers) not in (1, num_instances):
            raise ValueError(
                f"{len(servers)} cache servers for {num_instances} instances: give one shared "
                "server or one per instance"
            )
        self.spec = spec
        self._stack = ExitStack()
        base_dir = work_dir
        if base_dir is None:
            base_dir = Path(self._stack.enter_context(tempfile.TemporaryDirectory()))
        model_dir = write_model_dir(
            base_dir / "model", TinyModel(max_position_embeddings=spec.max_model_len)
        )
        self.server_of = [i if len(servers) > 1 else 0 for i in range(num_instances)]
        self.instances: list[ReplayInstance] = []
        try:
            for i in range(num_instances):
                with telemetry.instance_scope(i):
                    instance = ReplayInstance(
                        spec,
                        servers[self.server_of[i]],
                        model_dir,
                        engine_id=instance_engine_id(spec.connector_engine_id, i),
                        kv_events=router.needs_kv_events,
                    )
                self.instances.append(instance)
        except BaseException:
            self.close()
            raise
        first = self.instances[0]
        self.requests = RequestFactory(first.vllm_config, first.kv_cache_config)
        self.placement = FleetPlacement(self.instances, router, self.server_of)

    def close(self) -> None:
        for i, instance in enumerate(self.instances):
            with telemetry.instance_scope(i):
                instance.close()
        self.instances = []
        self._stack.close()
