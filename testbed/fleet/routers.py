"""Routers: where each arriving request goes. Strategies behind one interface, chosen by name
(:data:`ROUTERS`), each a few lines; their parameters are the run's ``router_params``.

A router sees the request (its id, group, prompt length and vLLM block hashes) and a
:class:`FleetView`: the router's own book of queued and running tokens per instance
(:mod:`testbed.fleet.load`), the index kept from KV events (routers that ask for it), and, for
the oracle only, what each instance's prefix cache really holds. It returns a
:class:`Choice`: the instance and, where it weighs instances, each one's cost (the lowest
wins). Ties go to the less loaded instance, then the lower index, so routing is deterministic;
``temperature`` samples instead, from the run's seed.

The prefix-aware cost (``kv_precise`` and ``prefix_approx``) follows Dynamo's KV router
(``cost = overlap_score_weight x prefill_blocks + decode_blocks``), with the cached prefix
credited per tier as llm-d's precise prefix-cache scorer weighs device and offloaded tiers::

    new_i  = blocks(P) - e_i - sum over sources s of credit_s x (blocks s adds beyond e_i)
    cost_i = prefill_weight x (queued_i + new_i) + running_i

in blocks of ``block_size`` tokens: ``e_i`` the request's leading blocks in instance ``i``'s
prefix cache; the sources of the cache server it uses are its L1 (``host``), its tiers below
(``disk``, ``remote``) and, with ``peers``, the L1 of another server (``p2p``), each block
credited by the cheapest source that holds it; ``credit_host = external_credit`` and a lower
source is credited by the time its load takes (``testbed.models.links``, profile
``tier_profile``, a block of ``block_bytes``)::

    credit_s = external_credit x load_time(host) / load_time(s)

``queued_i`` / ``running_i`` the router's book. docs/fleet.md discusses the choices.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import msgspec
import numpy as np

from testbed.fleet.block_index import BlockLocations
from testbed.fleet.kv_index import KVEventIndex, PrefixView
from testbed.fleet.load import LoadBook
from testbed.models.links import LOWER_ROUTES, tier_profile


@dataclass(frozen=True)
class RouteRequest:
    request_id: str
    group: str
    """The conversation (or document) of the workload; empty when it has none."""
    prompt_tokens: int
    block_hashes: Sequence[Hashable]
    """vLLM's hashes of the prompt's full blocks, as its KV events name them."""


@dataclass(frozen=True)
class FleetView:
    """What a router may look at when it decides."""

    num_instances: int
    block_size: int
    engine_blocks: int
    """Each instance's KV pool, in blocks."""
    load: LoadBook
    kv: KVEventIndex | None = None
    """The index kept from KV events (routers with ``needs_kv_events``)."""
    cached_blocks: Sequence[int] = ()
    """Per instance, the request's leading blocks its prefix cache holds now: the truth, which
    no deployed router has (the oracle's bound)."""


@dataclass(frozen=True)
class Choice:
    instance: int
    costs: tuple[float, ...] = ()
    """Per instance, the router's cost (the lowest wins); empty for routers that weigh none."""


class NoParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """This router takes no parameters."""


class PrefixCostParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    prefill_weight: float = 1.0
    """Dynamo's ``overlap_score_weight``: prefill blocks against running (decode) blocks."""
    external_credit: float = 0.8
    """How much of a block the cache server holds (and the instance's prefix cache does not)
    is credited: loading it is cheaper than computing it, dearer than holding it."""
    temperature: float = 0.0
    """0: the lowest cost wins; above: softmax sampling over the costs normalised to [0, 1]."""
    capacity_blocks: int | None = None
    """``prefix_approx`` only: blocks the router remembers per instance (``None``: the
    instance's KV pool, ``engine_blocks``)."""
    tier_profile: str = "gen4"
    """``kv_precise``: the hardware profile whose links price a load from each tier
    (``testbed.models.links.TIER_PROFILES``)."""
    block_bytes: int = 1 << 20
    """``kv_precise``: the KV bytes of one block (all layers), for the links' times."""
    peers: bool = False
    """``kv_precise``: the servers load from each other (``--p2p``): a block another server's
    L1 holds is credited as a peer load."""

    def __post_init__(self) -> None:
        if self.prefill_weight < 0 or not 0 <= self.external_credit <= 1:
            raise ValueError("prefill_weight must be >= 0 and external_credit in [0, 1]")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.capacity_blocks is not None and self.capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {self.capacity_blocks}")
        if self.block_bytes < 1:
            raise ValueError(f"block_bytes must be >= 1, got {self.block_bytes}")
        tier_profile(self.tier_profile)  # unknown: ValueError naming the profiles


class Router:
    """The interface (see the module docstring)."""

    name: ClassVar[str]
    needs_kv_events: ClassVar[bool] = False
    """It reads the index kept from KV events (:attr:`FleetView.kv`)."""
    needs_cached_blocks: ClassVar[bool] = False
    """It reads what each prefix cache holds (:attr:`FleetView.cached_blocks`)."""
    params_type: ClassVar[type[msgspec.Struct]] = NoParams

    def __init__(self, params: Any, num_instances: int, seed: int) -> None:
        self.params = params
        self.num_instances = num_instances
        self.rng = random.Random(seed)

    @classmethod
    def needs_events(cls) -> bool:
        """Whether it needs to know what the instances' caches hold (their KV events, or, in a
        replay fleet, their block pools)."""
        return cls.needs_kv_events or cls.needs_cached_blocks

    def choose(self, request: RouteRequest, fleet: FleetView) -> Choice:
        raise NotImplementedError

    def routed(self, request: RouteRequest, instance: int, fleet: FleetView) -> None:
        """The request went to ``instance`` (routers that remember)."""


def least_loaded(load: Sequence[int], among: Sequence[int] | None = None) -> int:
    """The instance with the fewest queued and running tokens (ties: the lower index)."""
    candidates = range(len(load)) if among is None else among
    return min(candidates, key=lambda i: (load[i], i))


class RoundRobin(Router):
    name = "round_robin"

    def __init__(self, params: Any, num_instances: int, seed: int) -> None:
        super().__init__(params, num_instances, seed)
        self._next = itertools.cycle(range(num_instances))

    def choose(self, request: RouteRequest, fleet: FleetView) -> Choice:
        return Choice(next(self._next))


class LeastLoaded(Router):
    name = "least_loaded"

    def choose(self, request: RouteRequest, fleet: FleetView) -> Choice:
        load = fleet.load.load_tokens()
        return Choice(least_loaded(load), tuple(float(x) for x in load))


class Session(Router):
    """Sticky per conversation (the request's ``group``): its first request goes to the least
    loaded instance, the rest follow. Requests without a group go to the least loaded."""

    name = "session"

    def __init__(self, params: Any, num_instances: int, seed: int) -> None:
        super().__init__(params, num_instances, seed)
        self._home: dict[str, int] = {}

    def choose(self, request: RouteRequest, fleet: FleetView) -> Choice:
        home = self._home.get(request.group) if request.group else None
        return Choice(home if home is not None else least_loaded(fleet.load.load_tokens()))

    def routed(self, request: RouteRequest, instance: int, fleet: FleetView) -> None:
        if request.group:
            self._home.setdefault(request.group, instance)


def source_credits(params: PrefixCostParams) -> dict[str, float]:
    """Per hit source (``host``, ``disk``, ``remote``, ``p2p``), the share of a block it is
    credited: ``external_credit`` for L1, less by the ratio of load times below it."""
    profile = tier_profile(params.tier_profile)
    block = np.array([float(params.block_bytes)])
    host_s = float(profile.load_s({"host": block})[0])
    credits = {"host": params.external_credit}
    for source in LOWER_ROUTES:
        source_s = float(profile.load_s({source: block})[0])
        credits[source] = params.external_credit * host_s / source_s
    return credits


def credited_blocks(engine: int, held: Sequence[tuple[float, int]]) -> float:
    """The credit of the blocks beyond ``engine`` that sources hold, ``held`` as ``(credit,
    leading blocks)`` per source: each block by the best credited source holding it."""
    covered, total = engine, 0.0
    for credit, blocks in sorted(held, key=lambda item: -item[0]):
        if blocks > covered:
            total += credit * (blocks - covered)
            covered = blocks
    return total


def tier_credits(view: PrefixView, credits: dict[str, float], peers: bool) -> list[float]:
    """Per instance, the credited blocks of its server's tiers (and peers) beyond its prefix
    cache (an unknown tier is credited as the slowest source)."""
    lowest = min(credits.values())
    result = []
    for i, engine in enumerate(view.engine):
        held = [(credits["host"], view.external[i])]
        held += [(credits.get(tier, lowest), blocks[i]) for tier, blocks in view.lower.items()]
        if peers and view.peer:
            held.append((credits["p2p"], view.peer[i]))
        result.append(credited_blocks(engine, held))
    return result


def prefix_costs(
    request: RouteRequest,
    fleet: FleetView,
    engine: Sequence[int],
    credited: Sequence[float],
    params: PrefixCostParams,
) -> list[float]:
    """The prefix-aware cost of each instance (module docstring), in blocks; ``credited``:
    per instance, the credited blocks beyond its prefix cache."""
    size = fleet.block_size
    blocks = -(-request.prompt_tokens // size)
    costs = []
    for i in range(fleet.num_instances):
        new = blocks - engine[i] - credited[i]
        queued = fleet.load.queued_tokens[i] / size
        running = fleet.load.running_tokens[i] / size
        costs.append(params.prefill_weight * (queued + new) + running)
    return costs


def pick(
    costs: Sequence[float], load: Sequence[int], temperature: float, rng: random.Random
) -> int:
    """The lowest cost (ties: less load, lower index), or with ``temperature`` a softmax
    sample over the costs normalised by their spread."""
    if temperature <= 0:
        return min(range(len(costs)), key=lambda i: (costs[i], load[i], i))
    low, spread = min(costs), (max(costs) - min(costs)) or 1.0
    weights = [math.exp(-(cost - low) / spread / temperature) for cost in costs]
    return rng.choices(range(len(costs)), weights=weights)[0]


class KVPrecise(Router):
    """Scores from the KV events of every instance: its prefix cache and its cache server's
    tiers (and, with ``peers``, the other servers), each block credited by its load time."""

    name = "kv_precise"
    needs_kv_events = True
    params_type = PrefixCostParams

    def __init__(self, params: Any, num_instances: int, seed: int) -> None:
        super().__init__(params, num_instances, seed)
        self.credits = source_credits(params)

    def choose(self, request: RouteRequest, fleet: FleetView) -> Choice:
        assert fleet.kv is not None, "kv_precise needs the KV event index"
        held = fleet.kv.prefix(request.block_hashes)
        credited = tier_credits(held, self.credits, self.params.peers)
        costs = prefix_costs(request, fleet, held.engine, credited, self.params)
        load = fleet.load.load_tokens()
        return Choice(pick(costs, load, self.params.temperature, self.rng), tuple(costs))


class PrefixApprox(Router):
    """The router's own index of the blocks it sent where (no events), forgetting the least
    recently sent beyond each instance's pool, as routers without KV events do."""

    name = "prefix_approx"
    params_type = PrefixCostParams

    def __init__(self, params: Any, num_instances: int, seed: int) -> None:
        super().__init__(params, num_instances, seed)
        self._sent: BlockLocations | None = None

    def _index(self, fleet: FleetView) -> BlockLocations:
        if self._sent is None:
            capacity = self.params.capacity_blocks or fleet.engine_blocks
            self._sent = BlockLocations(fleet.num_instances, capacity_blocks=capacity)
        return self._sent

    def choose(self, request: RouteRequest, fleet: FleetView) -> Choice:
        held = self._index(fleet).prefix_blocks(request.block_hashes)
        costs = prefix_costs(request, fleet, held, [0.0] * len(held), self.params)
        load = fleet.load.load_tokens()
        return Choice(pick(costs, load, self.params.temperature, self.rng), tuple(costs))

    def routed(self, request: RouteRequest, instance: int, fleet: FleetView) -> None:
        self._index(fleet).add(instance, request.block_hashes)


class Oracle(Router):
    """The longest prefix any instance's cache really holds, whatever the load: a bound on
    what routing can save (its routing loss is 0 by construction). Ties (most often: no
    instance holds anything) go to the least loaded."""

    name = "oracle"
    needs_cached_blocks = True

    def choose(self, request: RouteRequest, fleet: FleetView) -> Choice:
        held = fleet.cached_blocks
        best = max(held)
        among = [i for i, blocks in enumerate(held) if blocks == best]
        return Choice(least_loaded(fleet.load.load_tokens(), among), tuple(-float(b) for b in held))


ROUTERS: dict[str, type[Router]] = {
    cls.name: cls for cls in (RoundRobin, LeastLoaded, Session, PrefixApprox, KVPrecise, Oracle)
}
"""Router name -> class (its docstring says what it does; ``params_type`` its parameters)."""


def with_peers(name: str, params: dict[str, Any], p2p: bool) -> dict[str, Any]:
    """Router ``name``'s ``params`` for a run whose servers are peered (``p2p``): ``peers`` on
    where the router prices peer loads (``kv_precise``), unless the run's params set it."""
    cls = ROUTERS.get(name)
    if not p2p or cls is None or "peers" not in cls.params_type.__struct_fields__:
        return dict(params)
    return {"peers": True, **params}


def make_router(name: str, params: dict[str, Any], num_instances: int, seed: int) -> Router:
    """The router ``name`` with ``params``; unknown names, keys or values raise ValueError."""
    cls = ROUTERS.get(name)
    if cls is None:
        raise ValueError(f"unknown router {name!r}; choose one of {', '.join(ROUTERS)}")
    try:
        parsed = msgspec.convert(dict(params), cls.params_type, strict=False)
    except (msgspec.ValidationError, ValueError) as exc:
        raise ValueError(f"router {name} params: {exc}") from None
    return cls(parsed, num_instances, seed)
