"""What differs between the engines a run spec may name, as data: one row per engine.

:class:`~testbed.spec.runspec.RunSpec` reads a spec's row (:data:`ENGINE_RULES`) to check it
and never compares engine names; the run's registry (``testbed.run.registry.ENGINES``) is
keyed by the same names (:data:`ENGINE_NAMES`). Adding an engine: a name in
:data:`EngineName`, its row here, its entry in the registry.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Literal

from testbed.core.policies import POLICIES as SERVER_POLICY_NAMES
from testbed.models.oracle import POLICIES as ORACLE_POLICY_NAMES

EngineName = Literal["replay", "fleet", "vllm", "serve", "oracle"]
ENGINE_NAMES: tuple[EngineName, ...] = typing.get_args(EngineName)

SERVER_POLICIES = tuple(sorted(SERVER_POLICY_NAMES))
"""What the cache server evicts by (``testbed.core.policies``)."""
ORACLE_POLICIES = ORACLE_POLICY_NAMES
"""What the oracle simulates with a capacity (``testbed.models.oracle``; without one it is
the infinite cache)."""


@dataclass(frozen=True)
class EngineRules:
    """What a spec may ask of one engine."""

    policies: tuple[str, ...] = SERVER_POLICIES
    """The eviction policies it runs under (``policy``)."""
    model: bool = False
    """Whether it loads a model by name (``model``): the others use KV profiles."""
    routed: bool = False
    """Whether it puts several instances behind a router (``instances``, ``router``,
    ``router_params``)."""
    per_instance_servers: bool = False
    """Whether its instances may each have a cache server of their own (``servers``)."""
    closed_loop: bool = True
    """Whether it paces closed-loop users by its completions (workload param ``users``); an
    open-loop engine sends requests at times fixed in advance."""
    cache_server: bool = True
    """Whether it runs against a cache server (``tiers`` and the server's settings apply)."""


ENGINE_RULES: dict[EngineName, EngineRules] = {
    "replay": EngineRules(),
    "fleet": EngineRules(routed=True, per_instance_servers=True),
    "vllm": EngineRules(model=True, closed_loop=False),
    "serve": EngineRules(model=True, routed=True, per_instance_servers=True, closed_loop=False),
    "oracle": EngineRules(policies=ORACLE_POLICIES, cache_server=False),
}
"""Every engine's rules (the module docstring): replay (vLLM's scheduler, no model), fleet
(replay instances behind a router), vllm (the full engine), serve (vLLM OpenAI servers over
HTTP), oracle (prefix arithmetic, no server)."""


def engines_where(rule: str, conjunction: str = "and") -> str:
    """The engines whose ``rule`` holds, for messages (``"model"``: ``vllm and serve``;
    ``"closed_loop", "or"``: ``replay, fleet or oracle``)."""
    names = [name for name, rules in ENGINE_RULES.items() if getattr(rules, rule)]
    return f" {conjunction} ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
