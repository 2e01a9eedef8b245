"""What an engine runs: the run's :class:`~testbed.spec.runspec.RunSpec` itself, and what a run
resolves from its workload before the engine starts.

Every run key, and its one default, is the spec's: an engine reads ``spec.run.block_size``,
never a copy of its own, so that no engine can run with a value other than the one
``spec.json`` records. What the spec leaves to the workload (vLLM's KV pool and its
``max_model_len``) the run resolves (``testbed.run.servable.engine_spec``) and an
:class:`EngineSpec` holds; an engine's own switches (a replay's vLLM stats, the vllm engine's
deterministic waits) are its subclass's fields. :func:`connector_config` is the one place
the connector's settings are made from a run's spec.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from connector.config import ConnectorConfig
from testbed.core.credentials import ServerEndpoint
from testbed.spec.runspec import RunSpec


@dataclass(frozen=True)
class EngineSpec:
    run: RunSpec
    """The run's spec: every run key the engine reads, with its one default."""
    engine_blocks: int
    """vLLM's KV pool in blocks: the spec's ``engine_blocks``, or sized from the workload
    (small pools cause preemption)."""
    max_model_len: int
    """vLLM's longest request in tokens (from the workload: its longest, in whole blocks)."""
    engine_id: str | None = None
    """The connector's engine id, its sessions' namespace (``"{engine_id}:{request_id}"``);
    ``None``: the run's id."""

    @property
    def connector_engine_id(self) -> str:
        return self.engine_id or self.run.run_id

    @classmethod
    def of(cls, **values: Any) -> Self:
        """A spec from keyword values: this class's own fields by name, every other key a
        field of the :class:`RunSpec` it holds (whose defaults fill the rest)."""
        own = {f.name for f in dataclasses.fields(cls)} - {"run"}
        run = RunSpec(**{key: value for key, value in values.items() if key not in own})
        return cls(run=run, **{key: value for key, value in values.items() if key in own})


def connector_config(
    spec: RunSpec,
    server: ServerEndpoint,
    *,
    engine_id: str,
    model_name: str = "",
    mla: bool | None = None,
    wait: bool = True,
    faults: bool = True,
    token_file: Path | None = None,
    run_id: str = "",
    span_dir: str = "",
) -> ConnectorConfig:
    """The connector's settings for an engine of a run of ``spec`` against ``server``: the
    spec's chunk size, timeout, load and transfer modes, store timing and fault injection.

    ``wait``: lookups and loads wait up to the timeout for the server's answers (stores too,
    with the spec's ``store_wait``), so that what a run computes does not depend on this
    machine's speed; False: vLLM's own cadence, polled by steps. ``faults``: the spec's fault
    injection (with the server's admin token); False: none. ``token_file``: the connector
    reads its credential from that file (a process the run starts) instead of being given it.
    ``model_name``, ``mla``, ``run_id``, ``span_dir``: as :class:`ConnectorConfig`'s."""
    wait_s = spec.server_timeout_s if wait else 0.0
    drop = spec.fault_drop_fraction if faults else 0.0
    return ConnectorConfig(
        server_url=server.url,
        token="" if token_file is not None else server.token,
        token_file="" if token_file is None else str(token_file),
        mq_timeout_s=spec.server_timeout_s,
        chunk_size=spec.chunk_size,
        model_name=model_name,
        mla=mla,
        load_async=spec.load_async,
        lookup_wait_s=wait_s,
        load_wait_s=wait_s,
        store_wait_s=wait_s if spec.store_wait else 0.0,
        transfer_mode=spec.transfer_mode,
        engine_id=engine_id,
        run_id=run_id,
        span_dir=span_dir,
        fault_drop_fraction=drop,
        fault_seed=spec.seed if faults else 0,
        admin_token=server.admin_token if drop else "",
        lookup_mirror=spec.lookup_mirror,
    )
