"""The run spec's keys that combine an engine with its instances and servers: the fleet's
(``instances``, ``router``, ``router_params``, ``servers``, ``p2p``) and the connector's lookup
mirror (``lookup_mirror``, which sees one server's L1 and tiers, no peers), checked against the
engine's rules (:data:`testbed.spec.engines.ENGINE_RULES`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from testbed.spec.engines import ENGINE_RULES, EngineName, engines_where


class FleetKeys(Protocol):
    """The keys of a run spec this module reads (a ``RunSpec`` has them all)."""

    @property
    def engine(self) -> EngineName: ...
    @property
    def instances(self) -> int: ...
    @property
    def router(self) -> str: ...
    @property
    def router_params(self) -> dict[str, Any]: ...
    @property
    def servers(self) -> str: ...
    @property
    def p2p(self) -> bool: ...
    @property
    def seed(self) -> int: ...
    @property
    def tiers(self) -> Sequence[str]: ...
    @property
    def lookup_mirror(self) -> bool: ...


def mirror_problems(spec: FleetKeys) -> list[str]:
    """What is wrong with ``lookup_mirror`` here (it sees L1 alone, through the connector)."""
    if not spec.lookup_mirror:
        return []
    if not ENGINE_RULES[spec.engine].cache_server:
        return [f"lookup_mirror applies to the {engines_where('cache_server')} engines"]
    if spec.p2p or any(tier.split(":", 1)[0].split("@", 1)[0] == "redis" for tier in spec.tiers):
        return [
            "lookup_mirror cannot see what peers or other servers hold: run it without p2p "
            "and redis tiers (or without the mirror)"
        ]
    if spec.instances > 1 and spec.servers == "shared":
        return [
            "lookup_mirror learns what other instances commit to a shared server only a "
            "lookup later (its misses would be wrong): use --servers per-instance"
        ]
    return []


def fleet_problems(spec: FleetKeys) -> list[str]:
    """What is wrong with the spec's fleet keys (the router's parameters included)."""
    rules = ENGINE_RULES[spec.engine]
    problems = []
    if spec.instances < 1:
        problems.append(f"instances must be at least 1, got {spec.instances}")
    elif spec.instances > 1 and not rules.routed:
        problems.append(
            f"instances = {spec.instances} needs the fleet engine (or serve with several vLLM "
            "servers); use --engine fleet"
        )
    if spec.servers != "shared" and not rules.per_instance_servers:
        apply = engines_where("per_instance_servers")
        problems.append(f"servers 'per-instance' applies to the {apply} engine")
    if spec.p2p and not (rules.per_instance_servers and spec.servers == "per-instance"):
        problems.append(
            f"p2p is between the per-instance cache servers of a "
            f"{engines_where('per_instance_servers')} run: use --servers per-instance (a shared "
            "server has no peers)"
        )
    if not rules.routed and (spec.router, spec.router_params) != ("round_robin", {}):
        problems.append(f"router and router_params apply to the {engines_where('routed')} engines")
        return problems
    from testbed.fleet.routers import make_router

    try:
        make_router(spec.router, spec.router_params, max(spec.instances, 1), spec.seed)
    except ValueError as exc:
        problems.append(str(exc))
    return problems
