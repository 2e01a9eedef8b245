"""``kvtb bench``'s settings and sizes, and what every section gets to work with."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from testbed.bench.figures import Figure
from testbed.commands.quick_sizes import QuickOrFull

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

    rounds = QuickOrFull(3, 30)
    """Rounds of every comparison that repeats cheaply."""
    replay_rounds = QuickOrFull(1, 3)
    loader_spans = QuickOrFull(4_000, 200_000)
    e2e_lengths = QuickOrFull((1024,), (1024, 4096, 16384))
    e2e_samples = QuickOrFull(1, 15)
    """Samples of every engine at every length in the vLLM section (interleaved rounds)."""
    _replay_default = QuickOrFull(24, 2000)
    scale_requests = QuickOrFull(200, 1_000_000)
    """Requests of the generated chat workload of ``--only scale``."""
    scale_fleet_requests = QuickOrFull(32, None)
    """Requests of the trace on the 16-instance fleet (``None``: the whole trace)."""
    scale_copies = QuickOrFull(1, 30)
    """Times the shared agentic corpus is repeated (two capped sessions with ``--quick``)."""

    @property
    def replay_size(self) -> int | None:
        """Requests of the replay (``None``: the whole trace)."""
        if self.replay_requests is not None:
            return self.replay_requests or None
        return self._replay_default

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
