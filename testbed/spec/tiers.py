"""The run spec's tier keys (``tiers``, ``tier_write``, ``tier_promote``, ``prefetch``) checked
by the server's own parsers, so a spec is refused with the words a server would use."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from testbed.spec.engines import ENGINE_RULES, EngineName


class TierKeys(Protocol):
    """The keys of a run spec this module reads (a ``RunSpec`` has them all)."""

    @property
    def engine(self) -> EngineName: ...
    @property
    def tiers(self) -> Sequence[str]: ...
    @property
    def tier_write(self) -> str: ...
    @property
    def tier_promote(self) -> str: ...
    @property
    def prefetch(self) -> str: ...
    @property
    def metadata_only(self) -> bool: ...
    @property
    def policy(self) -> str: ...


def tier_problems(spec: TierKeys) -> list[str]:
    """What is wrong with the spec's tiers and tier policies (``server.tiers``)."""
    from server.tiers.policies import check_promote, parse_prefetch, parse_write
    from server.tiers.spec import parse_tier

    problems = []
    checks: list[tuple[str, Any]] = [(text, parse_tier) for text in spec.tiers]
    checks += [(spec.tier_write, parse_write), (spec.prefetch, parse_prefetch)]
    checks.append((spec.tier_promote, check_promote))
    for text, parse in checks:
        try:
            parse(text)
        except ValueError as err:
            problems.append(str(err))
    simulated = not ENGINE_RULES[spec.engine].cache_server  # the oracle's model of one tier
    if spec.tiers and simulated and (len(spec.tiers) > 1 or spec.policy != "lru"):
        problems.append(
            f"the {spec.engine} engine simulates one tier below L1 with LRU in both "
            f'(policy = "lru"); got {len(spec.tiers)} tiers and policy {spec.policy!r}'
        )
    if spec.tiers and spec.metadata_only:
        problems.append("tiers move KV bytes; a metadata_only run has none")
    return problems
