"""The hierarchy's policies by name, with the peers' semantics (pure values).

- write (L1 -> L2): ``write_through`` every committed chunk is written to every tier, off the
  store's critical path (LMCache's default, SGLang HiCache's ``write_through``);
  ``write_back`` a chunk goes down only when L1 evicts it (HiCache ``write_back``);
  ``selective:N`` a chunk goes down once it has been hit N times in L1 (KVBM's "hit twice",
  vLLM's ``store_threshold``, HiCache ``write_through_selective``).
- promote (an L2 hit): ``none`` the chunk is copied into L1 for the load that asked and
  dropped from L1 once no lock or pin holds it (LMCache's default); ``retain`` it stays in L1
  as a chunk stored there.
- prefetch (how long a lookup waits for L2 chunks to reach L1): ``wait`` until they have (at
  most ``lookup_pending_timeout_s``), ``timeout:S`` at most S seconds, ``best_effort`` not at
  all (the chunks arrive for a later lookup). Chunks not in L1 when the lookup is answered end
  the hit with miss status ``prefetch_timeout``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

WriteKind = Literal["write_through", "write_back", "selective"]
PromoteKind = Literal["none", "retain"]
PROMOTE_POLICIES: tuple[PromoteKind, ...] = ("none", "retain")
WRITE_SYNTAX = "write_through, write_back or selective:N (N >= 1 hits)"
PREFETCH_SYNTAX = "wait, best_effort or timeout:S (S > 0 seconds)"


@dataclass(frozen=True)
class WritePolicy:
    kind: WriteKind
    min_hits: int = 0
    """``selective``: the L1 hits after which a chunk is written down."""

    def __str__(self) -> str:
        return f"selective:{self.min_hits}" if self.kind == "selective" else self.kind


@dataclass(frozen=True)
class PrefetchPolicy:
    kind: Literal["wait", "best_effort", "timeout"]
    timeout_s: float | None = None

    def wait_s(self, pending_timeout_s: float) -> float:
        """How long a lookup may stay pending on its prefetch."""
        if self.kind == "best_effort":
            return 0.0
        if self.kind == "timeout" and self.timeout_s is not None:
            return self.timeout_s
        return pending_timeout_s

    def __str__(self) -> str:
        return f"timeout:{self.timeout_s:g}" if self.kind == "timeout" else self.kind


def parse_write(text: str) -> WritePolicy:
    if text in ("write_through", "write_back"):
        return WritePolicy(text)  # type: ignore[arg-type]
    head, _, count = text.partition(":")
    if head == "selective" and count.isdigit() and int(count) >= 1:
        return WritePolicy("selective", int(count))
    raise ValueError(f"tier write policy {text!r} is unknown; write {WRITE_SYNTAX}")


def parse_prefetch(text: str) -> PrefetchPolicy:
    if text in ("wait", "best_effort"):
        return PrefetchPolicy(text)  # type: ignore[arg-type]
    head, _, seconds = text.partition(":")
    if head == "timeout":
        try:
            value = float(seconds)
        except ValueError:
            value = math.nan
        if math.isfinite(value) and value > 0:
            return PrefetchPolicy("timeout", value)
    raise ValueError(f"prefetch policy {text!r} is unknown; write {PREFETCH_SYNTAX}")


def check_promote(text: str) -> PromoteKind:
    if text not in PROMOTE_POLICIES:
        raise ValueError(
            f"tier promotion policy {text!r} is unknown; choose one of "
            f"{', '.join(PROMOTE_POLICIES)}"
        )
    return text
