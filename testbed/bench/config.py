"""``kvtb bench``'s settings and sizes, and what every section gets to work with."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from testbed.bench.figures import Figure

TRACE_IN_CHECKOUT = Path("..") / "shared" / "data" / "mooncake" / "conversation_trace.jsonl"
"""Where a checkout finds the Mooncake conversation trace, relative to its root."""
_CHECKOUT_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class BenchConfig:
    out_dir: Path
    quick: bool = False
    """Small sizes everywhere (the test suite's run; the figures mean little)."""
    peer: bool = False
    """Also run the real LMCache side by side (its own virtual environment)."""
    trace: Path | None = None
    """The Mooncake conversation trace (``None``: the checkout's copy, see :func:`find_trace`)."""
    replay_requests: int | None = None
    """Requests of the trace the replay runs (``None``: the size's default; 0: all)."""
    peer_env: Path | None = None
    """The peer's virtual environment (``None``: ``testbed.bench.peer.env.default_root``)."""
    seed: int = 0

    @property
    def rounds(self) -> int:
        """Rounds of every comparison that repeats cheaply."""
        return 3 if self.quick else 30

    @property
    def replay_rounds(self) -> int:
        return 1 if self.quick else 3

    @property
    def replay_size(self) -> int | None:
        """Requests of the replay (``None``: the whole trace)."""
        if self.replay_requests is not None:
            return self.replay_requests or None
        return 24 if self.quick else 2000

    @property
    def loader_spans(self) -> int:
        return 4_000 if self.quick else 200_000

    @property
    def e2e_lengths(self) -> tuple[int, ...]:
        return (1024,) if self.quick else (1024, 4096, 16384)

    @property
    def e2e_samples(self) -> int:
        return 1 if self.quick else 7

    @property
    def work_dir(self) -> Path:
        return self.out_dir / "work"


def find_trace(config: BenchConfig) -> Path:
    """The trace to replay; ``FileNotFoundError`` saying where it was looked for."""
    candidates = (
        [config.trace] if config.trace else [TRACE_IN_CHECKOUT, _CHECKOUT_ROOT / TRACE_IN_CHECKOUT]
    )
    for path in candidates:
        if path.is_file():
            return path  # as given (relative paths stay relative in the report)
    raise FileNotFoundError(
        "the Mooncake conversation trace (conversation_trace.jsonl) is not at "
        + " nor ".join(str(p) for p in candidates)
        + "; pass --trace PATH"
    )


@dataclass(frozen=True)
class Table:
    """A detail table for BENCHMARKS.md (and ``results.json``'s ``tables``)."""

    title: str
    header: tuple[str, ...]
    rows: Sequence[Sequence[object]]
    note: str = ""


@dataclass
class SectionResult:
    figures: list[Figure] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
