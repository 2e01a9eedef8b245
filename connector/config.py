"""Connector configuration, read from vLLM's ``kv_connector_extra_config``, and the cache
server's own (:func:`server_config`, asked at start).

Every key is namespaced ``kvtb.``; an unknown ``kvtb.`` key or a bad value is an error that
names the key and the valid ones (a typo must not silently fall back to a default). The
fields below document each key (``kvtb.<field name>``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from testbed.core import protocol as p
from testbed.core.bounds import Bound, bound_problems, field_bounds
from testbed.core.rpc import RemoteError, RpcClient, ServerUnavailable
from testbed.core.typed_values import convert, hints

log = logging.getLogger(__name__)

PREFIX = "kvtb."
_HOUR_S = 3600.0
_TIMEOUT = Bound(1e-3, _HOUR_S, "s")
_WAIT = Bound(0.0, _HOUR_S, "s")


@dataclass(frozen=True)
class ConnectorConfig:
    server_url: str = "tcp://127.0.0.1:5555"
    """ZeroMQ endpoint of the cache server (``kvtb server`` prints it when ready)."""

    mq_timeout_s: Annotated[float, _TIMEOUT] = 5.0
    """Longest wait for any server reply. A timeout marks the server down: lookups answer 0
    and loads fail (the engine recomputes) until a heartbeat is answered again."""

    heartbeat_interval_s: Annotated[float, _TIMEOUT] = 10.0
    """Seconds between liveness heartbeats (the server reaps clients silent for longer than
    its ``--client-timeout``)."""

    chunk_size: Annotated[int, Bound(1, 1 << 16, "tokens")] = 256
    """Chunk size to assume if the server cannot be asked at start-up; otherwise the
    server's chunk size is used."""

    cache_salt: str = ""
    """Salt for requests that carry none of their own (isolates tenants or experiments)."""

    model_name: str = ""
    """Name used in cache keys; default: vLLM's model name or path."""

    mla: bool | None = None
    """Force MLA storage rules (one latent copy for all TP ranks); default: from the model."""

    load_async: bool = True
    """Load between scheduler steps (request waits in WAITING_FOR_REMOTE_KVS) rather than
    synchronously before the forward pass."""

    lookup_wait_s: Annotated[float, _WAIT] = 0.0
    """How long one ``get_num_new_matched_tokens`` call may wait for the lookup's answer
    before telling the scheduler to ask again next step. 0 keeps the scheduler non-blocking;
    replays set it so that results do not depend on timing."""

    lookup_mirror: bool = False
    """Answer lookups that will load nothing from a mirror of what the server holds, kept from
    this engine's stores and the commits and removals the server's replies carry
    (``connector.mirror``): a miss costs no round trip and no step's delay; a predicted hit
    asks the server as before. A run refuses it with peers (``p2p``) or a store other servers
    write to (a ``redis`` tier): what those hold, it cannot see."""

    load_wait_s: Annotated[float, _WAIT] = 0.0
    """How long ``get_finished`` may wait for in-flight retrieves (replays: deterministic)."""

    store_wait_s: Annotated[float, _WAIT] = 0.0
    """How long ``get_finished`` may wait for in-flight stores. 0: stores complete on their
    own timing (the forward pass never waits for them; a repeat request may find its
    predecessor's store still in flight). Replays set it so that every step's stores commit
    within the step and results do not depend on timing."""

    transfer_mode: str = "auto"
    """Who copies KV between vLLM's blocks and the cache server's pool: ``worker`` (this
    connector, in vLLM's worker), ``server`` (the cache server, from the KV tensors the
    worker moves into shared memory at registration, or maps through CUDA IPC on a GPU:
    LMCache's lmcache_driven / server-driven modes), or ``auto``: ``server`` for CUDA KV,
    ``worker`` for CPU KV."""

    store_decode_tokens: bool = False
    """Also store complete chunks of generated tokens (default: prompt chunks only)."""

    engine_id: str = ""
    """Namespace for session ids shared by one engine's scheduler and workers; default:
    vLLM's ``kv_transfer_config.engine_id``."""

    token: str = ""
    """The server's client token (see ``kvtb server``'s token file); default: from
    ``token_file``, else the ``KVTB_TOKEN`` / ``KVTB_TOKEN_FILE`` variables."""

    token_file: str = ""
    """A server's token file (the readiness line prints its path) to read the token from."""

    curve_secret_key: str = ""
    """ZeroMQ CURVE: this client's secret key file (``*.key_secret``), for a server bound
    beyond loopback; needs ``curve_server_key``."""

    curve_server_key: str = ""
    """ZeroMQ CURVE: the server's public key file (``server.key``)."""

    span_dir: str = ""
    """Where the connector writes its spans when vLLM's process has no kvtestbed tracing of its
    own (a directory receiving ``spans/``, e.g. ``kvtb server --run-dir``; default
    ``KVTB_SPAN_DIR``; the ``OTEL_*`` variables can ask for OTLP export instead)."""

    run_id: str = ""
    """``kvcache.run_id`` of the connector's spans (groups a deployment's traces)."""

    fault_drop_fraction: Annotated[float, Bound(0.0, 1.0)] = 0.0
    """Fault injection for experiments: the share of retrieves whose first chunk rank 0 drops
    from the server just before retrieving it (the load-error path, under vLLM's own
    recovery). Which retrieves is decided by a hash of the chunk key the retrieve starts at, its
    attempt and ``fault_seed`` (``connector.faults``), so every engine drops the same requests'
    chunks. Needs ``admin_token``."""

    fault_seed: int = 0
    """Seed of the fault injection's choice."""

    admin_token: str = ""
    """The server's admin token (only fault injection uses it)."""

    def __post_init__(self) -> None:
        problems = bound_problems(self, lambda name: PREFIX + name)
        if not self.server_url.startswith(("tcp://", "ipc://", "inproc://")):
            problems.append(
                "server_url must be a ZeroMQ endpoint such as tcp://127.0.0.1:5555, "
                f"got {self.server_url!r}"
            )
        if self.transfer_mode not in ("auto", "worker", "server"):
            problems.append(
                f"transfer_mode must be 'auto', 'worker' or 'server', got {self.transfer_mode!r}"
            )
        if bool(self.curve_secret_key) != bool(self.curve_server_key):
            problems.append("curve_secret_key and curve_server_key go together")
        if self.fault_drop_fraction and not self.admin_token:
            problems.append("fault_drop_fraction needs admin_token (it drops objects)")
        if problems:
            raise ValueError("invalid kvtb connector config: " + "; ".join(problems))

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        """Reads the ``kvtb.*`` keys of ``kv_connector_extra_config`` (others are ignored);
        text values are read as their field's type (``"false"``, ``"5.0"``)."""
        fields = hints(cls)
        values: dict[str, Any] = {}
        for key, value in (extra or {}).items():
            if not key.startswith(PREFIX):
                continue
            name = key.removeprefix(PREFIX)
            if name not in fields:
                valid = ", ".join(PREFIX + n for n in fields)
                raise ValueError(f"unknown connector config key {key!r}; valid keys: {valid}")
            values[name] = convert(value, fields[name], f"connector config key {key!r}")
        return cls(**values)

    def to_extra_config(self) -> dict[str, Any]:
        return {PREFIX + f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


BOUNDS: dict[str, Bound] = field_bounds(ConnectorConfig)
"""The numeric keys' declared ranges (RELIABILITY.md lists them): timeouts finite (``nan``
and ``inf`` refused)."""


def server_config(rpc: RpcClient, config: ConnectorConfig) -> p.ServerConfigInfo | None:
    """The cache server's configuration (its chunk size, whether its lookups fill L1, ...);
    ``None`` with a warning when it does not answer (the connector assumes its own chunk size
    and misses until the server is up)."""
    try:
        info = rpc.call(p.GetConfig())
    except (ServerUnavailable, RemoteError) as exc:
        log.warning(
            "cache server at %s not reachable (%s); assuming chunk size %d, misses until it is",
            config.server_url,
            exc,
            config.chunk_size,
        )
        return None
    assert isinstance(info, p.ServerConfigInfo)
    return info


def refuse_pipeline_parallelism(pipeline_parallel_size: int) -> None:
    """``ValueError`` for more than one pipeline stage (the cache keys do not tell the stages'
    layers apart)."""
    if pipeline_parallel_size > 1:
        raise ValueError(
            f"KVTBConnector does not support pipeline parallelism (pipeline_parallel_size="
            f"{pipeline_parallel_size}): each pipeline stage holds other layers' "
            "KV under the same cache keys. Start vLLM with --pipeline-parallel-size 1 "
            "(tensor parallelism, --tensor-parallel-size, is supported)."
        )
