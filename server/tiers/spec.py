"""A tier below L1 as the user names it: ``KIND[@POLICY]:CAPACITY[:WHERE]``.

``disk:8GiB:/data/kv`` is a local-disk tier of 8 GiB in ``/data/kv``; ``disk:512MiB`` one in a
directory of the run's own; ``redis:4GiB:redis://127.0.0.1:6379`` a Redis tier at that URL
(without it the run starts its own). ``@POLICY`` names the tier's eviction policy (a key of
``testbed.core.policies.POLICIES``, ``lru`` when absent): ``disk@lfu:8GiB``. The text is split
on its first two ``:`` only, so a WHERE may contain ``:`` (a URL). Pure values: nothing here
touches a file or the network.
"""

from __future__ import annotations

from typing import Literal, get_args

import msgspec

from testbed.core.policies import POLICIES
from testbed.core.sizes import parse_bytes

TierKind = Literal["disk", "redis"]
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
"""The URLs a redis tier's WHERE may be (TCP, TLS, a unix socket: the run's own store)."""
TIER_KINDS: tuple[str, ...] = get_args(TierKind)
TIER_SYNTAX = (
    "KIND[@POLICY]:CAPACITY[:WHERE] (e.g. disk:8GiB:/data/kv, disk@lfu:512MiB, redis:4GiB)"
)


class TierSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One tier below L1, in order (the first is L2)."""

    kind: TierKind
    capacity_bytes: int
    """Upper bound on the bytes the tier holds (its objects' payloads); never exceeded."""
    where: str | None = None
    """A directory (disk) or a URL ``redis://HOST:PORT`` (redis); ``None``: the run's own."""
    policy: str = "lru"
    """The tier's eviction policy (a key of ``POLICIES``)."""


def parse_tier(text: str) -> TierSpec:
    """The tier ``text`` names; a ``ValueError`` that says what to write otherwise."""
    parts = text.strip().split(":", 2)
    if len(parts) < 2 or not parts[0] or not parts[1]:
        raise ValueError(f"not a tier: {text!r}; write {TIER_SYNTAX}")
    kind, _, policy = parts[0].partition("@")
    kind = kind.lower()
    if kind not in TIER_KINDS:
        raise ValueError(
            f"tier {text!r}: unknown kind {kind!r}; choose one of {', '.join(TIER_KINDS)} "
            f"({TIER_SYNTAX})"
        )
    policy = policy or "lru"
    if policy not in POLICIES:
        raise ValueError(
            f"tier {text!r}: unknown eviction policy {policy!r}; choose one of "
            f"{', '.join(sorted(POLICIES))}"
        )
    try:
        capacity = parse_bytes(parts[1])
    except ValueError as err:
        raise ValueError(f"tier {text!r}: {err}") from None
    if capacity < 1:
        raise ValueError(f"tier {text!r}: the capacity must be at least 1 byte")
    where = parts[2] if len(parts) == 3 and parts[2] else None
    if kind == "redis" and where is not None and not where.startswith(REDIS_SCHEMES):
        raise ValueError(
            f"tier {text!r}: a redis tier's WHERE is a URL redis://HOST:PORT "
            "(or unix:///PATH/redis.sock)"
        )
    return TierSpec(kind=kind, capacity_bytes=capacity, where=where, policy=policy)  # type: ignore[arg-type]


def format_tier(spec: TierSpec) -> str:
    """The text :func:`parse_tier` reads back as ``spec`` (capacity in plain bytes)."""
    head = spec.kind if spec.policy == "lru" else f"{spec.kind}@{spec.policy}"
    text = f"{head}:{spec.capacity_bytes}"
    return text if spec.where is None else f"{text}:{spec.where}"


def tier_name(index: int) -> str:
    """The level of the ``index``-th tier below L1 (0: ``L2``)."""
    return f"L{index + 2}"
