"""What one run is: a frozen, validated spec, named by the hash of its resolved form.

Every ``kvtb run`` flag is a field here (``--chunk-size`` ↔ ``chunk_size``), and so is every key
of a sweep's ``[base]`` and ``[grid]``. :func:`RunSpec.from_mapping` rejects unknown keys with
the list of valid ones; every numeric field declares its range in its annotation
(:mod:`testbed.core.bounds`; :data:`BOUNDS` lists them), checked before anything else, so that a
value no run could use fails at once with its range.

Run identity: :attr:`RunSpec.run_id` is a short hash of :data:`SPEC_SCHEMA` and *every* field
of the resolved spec (defaults included), so the same experiment always lands in the same
directory and two different resolved specs never share one. A finished run is reused only if
its ``spec.json`` (:meth:`RunSpec.document`) equals today's resolved spec
(:meth:`RunSpec.differences` is empty); a field it lacks is a difference, unless
:data:`SPEC_MIGRATIONS` says which value the runs made before the field existed had.
Changing a default therefore changes the id of every spec that relies on it: the old runs are
not reused, they are redone under a new id. A trace workload counts by its content
(``workload_digest``), not its path (:func:`identity`): a moved checkout keeps its run ids.

The spec holds values, not the machine: paths are made absolute, traces hashed and the
sampler read from the environment when a spec is parsed (:mod:`testbed.spec.inputs`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from testbed.core.bounds import Bound, bound_problems, field_bounds
from testbed.core.protocol import PoolMedium
from testbed.core.sizes import parse_bytes
from testbed.core.telemetry import sampling
from testbed.core.telemetry.sampling import DEFAULT_SAMPLER
from testbed.core.typed_values import convert, hints, literal_problems, means_absent, type_name
from testbed.models.profiles import PROFILES, KVProfile, get_profile
from testbed.spec.engines import ENGINE_NAMES, ENGINE_RULES, EngineName, engines_where
from testbed.spec.fleet_keys import fleet_problems, mirror_problems
from testbed.spec.tiers import tier_problems

ENGINES = ENGINE_NAMES
FleetServers = Literal["shared", "per-instance"]
TransferMode = Literal["worker", "server"]
Arrival = Literal["trace", "all"]
MLA_VARIANTS = {"tiny": "tiny-mla", "llama3-8b": "deepseek-mla"}

SPEC_SCHEMA = 3
"""What the fields mean, as a version; part of every run id and of ``spec.json``. Bump it when
a field's meaning changes while its name and value stay (e.g. a capacity counted in another
unit), so that no run made under the old meaning is reused. Version 1: ``spec.json`` without
``spec_schema``, ids hashed from the fields that differed from their defaults. Version 2: every
field hashed. Version 3: a trace workload is identified by its content (``workload_digest``),
not its path, the trace sampler and the pool's medium are fields, and ``engine_blocks``
defaults to a pool sized from the workload; runs of version 2 are redone, not migrated,
because nothing recorded whether their traces were sampled or which file content they read."""
SPEC_MIGRATIONS: dict[str, Any] = {
    "instances": 1,
    "router": "round_robin",
    "router_params": {},
    "servers": "shared",
    "p2p": False,
    "tiers": [],
    "tier_write": "write_through",
    "tier_promote": "none",
    "prefetch": "wait",
    "lookup_mirror": False,
}
"""Documented migrations: fields added to :class:`RunSpec` after runs were made, each with the
value that runs made before it existed implicitly had (the value that reproduces exactly what
they did). While a field has that value it is left out of the run id (older ids stay), and a
``spec.json`` that lacks the field compares as holding it. Added since version 3: the fleet's
``instances``, ``router``, ``router_params`` and ``servers`` (runs before them had one
instance); the hierarchy's ``tiers``, ``tier_write``, ``tier_promote`` and ``prefetch`` (runs
before them had L1 alone); the connector's ``lookup_mirror`` (runs before it asked the server
every lookup)."""
DERIVED_KEYS = ("workload_digest",)
"""Fields that follow from another field when a spec is parsed (not a parameter to vary)."""
_HOUR_S = 3600.0
DOCUMENT_ONLY_KEYS = ("run_id", "spec_schema", "effective")
"""``spec.json`` keys that are not fields: the id, the schema, and ``effective`` (what an
engine actually ran where it differs from the spec), none of them compared."""


@dataclass(frozen=True)
class RunSpec:
    engine: EngineName = "replay"
    """replay (vLLM's scheduler, no model), fleet (replay instances behind a router),
    vllm (full engine), serve (vLLM OpenAI servers over HTTP: kvtb run --endpoint URL, or
    --launch), oracle (no server); what each accepts: :mod:`testbed.spec.engines`."""
    workload: str = "chat"
    """A generator name (chat, docqa, rag, random) or a trace, ``KIND:PATH`` (mooncake:PATH, or
    agentic:PATH: a kv-cache-tester conversation file or directory): the path absolute once
    parsed (:mod:`testbed.spec.inputs`), recorded, not part of the id."""
    requests: Annotated[int | None, Bound(1, 10_000_000, "requests")] = 200
    """How many requests (traces: the first N; None: all)."""
    seed: Annotated[int, Bound(0, 2**63 - 1)] = 0
    """The seed of the workload generator, the router and the fault injection's choice."""
    chunk_size: Annotated[int, Bound(1, 1 << 16, "tokens")] = 256
    """Tokens per cache chunk, the unit the cache server stores and hits (a multiple of
    block_size)."""
    tp: Annotated[int, Bound(1, 256, "ranks")] = 1
    """Tensor-parallel ranks: each rank stores its own share of a chunk's KV."""
    mla: bool = False
    """Use the profile's MLA variant (one latent copy for all TP ranks)."""
    profile: str = "tiny"
    """KV shape: tiny (128 B/token), tiny-mla, llama3-8b, deepseek-mla."""
    model: str | None = None
    """vllm engine: a model name or path (GPU machines); None: the tiny model the testbed
    writes (CPU)."""
    capacity_tokens: Annotated[int | None, Bound(1, 1 << 40, "tokens")] = None
    """Cache capacity in tokens of KV (all ranks); None with capacity_bytes None: unlimited."""
    capacity_bytes: Annotated[int | None, Bound(1, 1 << 50, "bytes")] = None
    """Cache capacity in bytes (alternative to capacity_tokens)."""
    policy: str = "lru"
    """Eviction policy: lru, fifo, lfu (server); those or belady (oracle)."""
    engine_blocks: Annotated[int | None, Bound(2, 1 << 24, "blocks")] = None
    """vLLM's own KV pool, in blocks of block_size tokens. None: sized from the workload, room
    for its longest request twice over (``testbed.run.footprint.pool_blocks``), so that reuse
    beyond a few requests needs the external cache; a number: that pool (longer requests are
    left out)."""
    block_size: Annotated[int, Bound(1, 1 << 12, "tokens")] = 64
    """vLLM's KV block, in tokens (a multiple of 32 on vLLM's CPU build)."""
    max_num_batched_tokens: Annotated[int, Bound(1, 1 << 24, "tokens")] = 8192
    """vLLM's token budget of one engine step."""
    max_num_seqs: Annotated[int, Bound(1, 1 << 16, "requests")] = 64
    """vLLM's cap on requests running at once (serve: requests in flight)."""
    max_output_tokens: Annotated[int | None, Bound(1, 1 << 20, "tokens")] = 16
    """Cap on generated tokens per request (None: as the workload says)."""
    load_async: bool = True
    """Loads from the cache server complete behind the forward pass (off: each step waits for
    its loads)."""
    prefix_caching: bool = True
    """vLLM's own prefix cache (off: every hit comes from the cache server)."""
    transfer_mode: TransferMode = "worker"
    """Who copies KV between vLLM's blocks and the server's pool: ``worker`` (the connector,
    in vLLM's worker) or ``server`` (the cache server, from the KV the worker moved into
    shared memory: LMCache's lmcache_driven)."""
    store_wait: bool = True
    """Each step's stores commit before the step reports (hits then do not depend on this
    machine's speed); False: stores complete behind the forward pass, as in production, and a
    repeat may arrive while its predecessor's store is still in flight."""
    arrival: Arrival = "trace"
    """When requests arrive: ``trace`` (the workload's own times, or its closed-loop users) or
    ``all`` (every request at once)."""
    metadata_only: bool = False
    """Account sizes without copying KV bytes (capacity sweeps larger than memory)."""
    pool_medium: PoolMedium = "shm"
    """Where the run's own cache server keeps its pool: ``shm`` (``/dev/shm``) or ``disk`` (the
    temporary directory; copy times then measure a disk-backed pool). Its memory is reserved
    when the server starts; a pool that does not fit is refused before the run."""
    fault_drop_fraction: Annotated[float, Bound(0.0, 1.0)] = 0.0
    """Fault injection: the share of retrieves whose first chunk is dropped from the server just
    before it is read (vLLM's load-error recovery then runs), chosen by a hash of the seed."""
    server_timeout_s: Annotated[float, Bound(1e-3, _HOUR_S, "s")] = 30.0
    """The connector's longest wait for a server reply (``kvtb.mq_timeout_s``): a dead or hung
    server stalls no engine step for longer."""
    time_profile: str = "h100"
    """Replay: the hardware whose step time the projected clock charges (h100, h200, a100,
    l40s: a roofline of compute, memory and loads; see METRICS.md), or flat (5 ms + 40 µs per
    scheduled token, loads free)."""
    time_model: str | None = None
    """Replay: the model whose compute the clock charges; None: the KV profile if it has a
    compute shape (llama3-8b, deepseek-mla), else llama3-8b (the tiny profiles only keep the
    cache's bytes small)."""
    trace_sampler: str = DEFAULT_SAMPLER
    """The OpenTelemetry sampler of every process of the run (OTEL_TRACES_SAMPLER's names;
    read from that variable when the spec is parsed). A sampled run records some requests
    only: its summary says so and its token figures are estimates."""
    trace_sampler_ratio: float | None = None
    """The share of traces a ratio sampler keeps (OTEL_TRACES_SAMPLER_ARG); None otherwise."""
    workload_params: dict[str, Any] = field(default_factory=dict)
    """Generator parameters (see testbed.workloads)."""
    workload_digest: str | None = None
    """A trace workload's content hash (``sha256:...``), set when the spec is parsed: with the
    trace's kind, what the run id hashes instead of its path (:mod:`testbed.spec.inputs`)."""
    instances: int = 1
    """fleet: instances behind the router; serve: vLLM servers (--launch starts them)."""
    router: str = "round_robin"
    """fleet and serve: round_robin, least_loaded, session, prefix_approx, kv_precise or
    oracle (docs/fleet.md)."""
    router_params: dict[str, Any] = field(default_factory=dict)
    """The router's parameters (kv_precise, prefix_approx: prefill_weight, external_credit,
    temperature; prefix_approx: capacity_blocks)."""
    servers: FleetServers = "shared"
    """fleet, and serve with --launch: one cache server for every instance (shared) or one
    each (per-instance)."""
    p2p: bool = False
    """servers 'per-instance': a lookup that misses on an instance's server asks the other
    instances' servers, and a peer's hit is copied into it (hit source ``p2p``)."""
    tiers: list[str] = field(default_factory=list)
    """Tiers below the cache server's L1, in order, each ``KIND[@POLICY]:CAPACITY[:WHERE]``
    (``disk:8GiB:/data/kv``; without WHERE a disk tier uses a directory of the run's own,
    removed at the end); ``--tier``, repeatable. See docs/tiers.md."""
    tier_write: str = "write_through"
    """When a chunk goes below L1: write_through, write_back or selective:N."""
    tier_promote: str = "none"
    """A hit below L1: none (copied into L1 for its load only) or retain (stays in L1)."""
    prefetch: str = "wait"
    """How long a lookup waits for chunks below L1: wait, timeout:S or best_effort."""
    lookup_mirror: bool = False
    """The scheduler answers lookups that will load nothing from its mirror of what the
    cache server holds (no round trip, no step's delay for a miss; a predicted hit asks the
    server). Not with p2p or a redis tier. See docs/connector.md."""

    def __post_init__(self) -> None:
        problems = bound_problems(self) + literal_problems(self)
        if problems:  # the rules below read the engine's row
            raise ValueError("invalid run spec: " + "; ".join(problems))
        problems += _profile_problems(self) + _engine_problems(self)
        if self.transfer_mode == "server" and self.metadata_only:
            problems.append(
                "transfer_mode 'server' copies KV bytes; a metadata_only run has none "
                "(use transfer_mode 'worker')"
            )
        if self.block_size >= 1 and self.chunk_size % self.block_size:
            problems.append(
                f"chunk_size {self.chunk_size} must be a multiple of block_size {self.block_size}"
            )
        if self.capacity_tokens is not None and self.capacity_bytes is not None:
            problems.append("give capacity_tokens or capacity_bytes, not both")
        problems += fleet_problems(self) + tier_problems(self) + mirror_problems(self)
        problems += sampling.check(self.trace_sampler, self.trace_sampler_ratio)
        if self.workload_digest is not None and ":" not in self.workload:
            problems.append("workload_digest applies to trace workloads (KIND:PATH) only")
        if problems:
            raise ValueError("invalid run spec: " + "; ".join(problems))

    @property
    def compute_profile(self) -> KVProfile:
        """The model the replay's projected clock charges (see ``time_model``)."""
        if self.time_model is not None:
            return get_profile(self.time_model)
        return self.kv_profile if self.kv_profile.has_compute_shape else get_profile("llama3-8b")

    @property
    def kv_profile(self) -> KVProfile:
        name = MLA_VARIANTS.get(self.profile, self.profile) if self.mla else self.profile
        return get_profile(name)

    def capacity(self) -> int | None:
        """Capacity in bytes, or ``None`` for unlimited."""
        if self.capacity_bytes is not None:
            return self.capacity_bytes
        if self.capacity_tokens is not None:
            return self.capacity_tokens * self.kv_profile.stored_bytes_per_token(self.tp)
        return None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def run_id(self) -> str:
        """A short hash of :data:`SPEC_SCHEMA` and every field (see the module docstring)."""
        fields = {
            key: value
            for key, value in identity(_as_stored(self.to_dict())).items()
            if not (key in SPEC_MIGRATIONS and value == _as_stored(SPEC_MIGRATIONS[key]))
        }
        canonical = json.dumps(
            {"spec_schema": SPEC_SCHEMA, "fields": fields}, sort_keys=True, separators=(",", ":")
        )
        return hashlib.sha256(canonical.encode()).hexdigest()[:12]

    def document(self) -> dict[str, Any]:
        """What ``spec.json`` holds: the run id, the schema version and every field."""
        return {"run_id": self.run_id, "spec_schema": SPEC_SCHEMA, **self.to_dict()}

    def differences(self, stored: Mapping[str, Any]) -> list[str]:
        """How a run's ``spec.json`` differs from this spec, one line per field; empty when the
        run is a run of exactly this spec (after :data:`SPEC_MIGRATIONS`)."""
        expected = identity(_as_stored(self.to_dict()))
        found = {k: v for k, v in stored.items() if k not in DOCUMENT_ONLY_KEYS}
        for key, value in SPEC_MIGRATIONS.items():
            found.setdefault(key, _as_stored(value))
        found = identity(found)
        lines = []
        schema = stored.get("spec_schema", 1)
        if schema != SPEC_SCHEMA:
            lines.append(f"spec_schema: {schema!r} in spec.json, now {SPEC_SCHEMA}")
        for key, value in expected.items():
            if key not in found:
                lines.append(f"{key}: missing in spec.json, now {value!r}")
            elif found[key] != value or type(found[key]) is not type(value):
                lines.append(f"{key}: {found[key]!r} in spec.json, now {value!r}")
        lines += [f"{key}: in spec.json, no longer a field" for key in found if key not in expected]
        return lines

    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, source: str = "spec") -> RunSpec:
        """A spec from TOML-like values; unknown keys and bad values name the key and source."""
        unknown = sorted(set(values) - set(cls.keys()))
        if unknown:
            raise ValueError(
                f"{source}: unknown key{'s' if len(unknown) > 1 else ''} "
                f"{', '.join(map(repr, unknown))}; valid keys: {', '.join(cls.keys())}"
            )
        resolved = dict(values)
        if isinstance(resolved.get("tiers"), str):  # one tier: tiers = "disk:1GiB"
            resolved["tiers"] = [resolved["tiers"]]
        if "capacity_bytes" in resolved and isinstance(resolved["capacity_bytes"], str):
            resolved["capacity_bytes"] = parse_bytes(resolved["capacity_bytes"])
        types = hints(cls)
        for name, value in list(resolved.items()):
            if isinstance(value, str) and means_absent(value, types[name]):
                value = None
            # strict: TOML values are typed; an int for a float field becomes one (1 and 1.0
            # must name the same run)
            resolved[name] = convert(
                value,
                types[name],
                name,
                strict=True,
                message=f"{source}: {name} = {value!r} is not a value of type "
                + type_name(types[name]),
            )
        try:
            return cls(**resolved)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{source}: {exc}") from None


BOUNDS: dict[str, Bound] = field_bounds(RunSpec)
"""The ranges the numeric fields declare (RELIABILITY.md lists them); the machine's memory is
checked separately, before a run starts (``testbed.run.footprint``)."""


def _profile_problems(spec: RunSpec) -> list[str]:
    """What is wrong with the spec's KV profile and the replay clock's profiles."""
    from testbed.models.hardware import HARDWARE
    from testbed.models.time_model import FLAT

    problems = []
    if spec.profile not in PROFILES:
        problems.append(f"profile must be one of {sorted(PROFILES)}, got {spec.profile!r}")
    elif spec.mla and spec.profile not in MLA_VARIANTS and not PROFILES[spec.profile].mla:
        problems.append(
            f"profile {spec.profile!r} has no MLA variant; use one of {sorted(MLA_VARIANTS)}"
        )
    if spec.time_profile not in (FLAT, *HARDWARE):
        problems.append(
            f"time_profile {spec.time_profile!r} is unknown; choose one of "
            f"{', '.join((FLAT, *HARDWARE))}"
        )
    if spec.time_model is not None and (
        spec.time_model not in PROFILES or not PROFILES[spec.time_model].has_compute_shape
    ):
        shaped = sorted(n for n, prof in PROFILES.items() if prof.has_compute_shape)
        problems.append(
            f"time_model {spec.time_model!r} is not a profile with a compute shape; choose "
            f"one of {', '.join(shaped)}"
        )
    return problems


def _engine_problems(spec: RunSpec) -> list[str]:
    """What the spec asks of its engine that the engine's row (:mod:`testbed.spec.engines`)
    does not allow: a policy, a model, closed-loop users."""
    rules = ENGINE_RULES[spec.engine]
    problems = []
    if spec.policy not in rules.policies:
        problems.append(
            f"policy {spec.policy!r} is not available with engine {spec.engine}; "
            f"choose one of {', '.join(rules.policies)}"
        )
    if spec.model is not None and not rules.model:
        problems.append(
            f"model applies to the {engines_where('model')} engines only "
            f"({spec.engine} uses KV profiles)"
        )
    if ":" in spec.workload and _closed_loop(spec.workload, spec.workload_params):
        if not rules.closed_loop:
            problems.append(
                "closed-loop users (workload param users) need the "
                f"{engines_where('closed_loop', 'or')} engine: the {spec.engine} engine "
                "sends requests at times fixed in advance; leave users out to replay the "
                "trace's own timestamps"
            )
        if spec.arrival != "trace":
            problems.append(
                f"arrival {spec.arrival!r} sends every request at once; closed-loop users "
                "(workload param users) need arrival 'trace'"
            )
    return problems


def _closed_loop(workload: str, params: Mapping[str, Any]) -> bool:
    """Whether a trace workload has closed-loop arrivals (imported only for trace workloads:
    the default spec, which ``kvtb server``'s flags build, stays clear of the lab packages)."""
    from testbed.workloads import closed_loop

    return closed_loop(workload, params)


def identity(fields: Mapping[str, Any]) -> dict[str, Any]:
    """The fields as a run's identity: a trace workload with a digest by its kind and content
    (``mooncake:`` and ``workload_digest``), its path left out, so that a moved checkout or
    data directory keeps the run ids."""
    result = dict(fields)
    if result.get("workload_digest") and isinstance(result.get("workload"), str):
        result["workload"] = result["workload"].partition(":")[0] + ":"
    return result


def _as_stored(value: Any) -> Any:
    """``value`` as ``spec.json`` holds it (JSON types), so that comparisons see what a
    finished run's file says."""
    return json.loads(json.dumps(value, sort_keys=True, default=str))
