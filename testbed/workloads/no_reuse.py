"""``random``: independent uniformly random prompts, no reuse (a baseline)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from testbed.workloads.base import check_range, raise_problems
from testbed.workloads.generator import REQUEST, Generator, check_rate


@dataclass(frozen=True)
class RandomParams:
    """Parameters of ``random``: independent uniformly random prompts."""

    prompt_tokens: tuple[int, int] = (256, 4096)
    """Length range of each prompt."""

    output_tokens: tuple[int, int] = (32, 256)
    """Length range of each answer."""

    arrival_rate_per_s: float = 2.0
    """Poisson arrival rate of requests (``inf``: all at time 0)."""

    def __post_init__(self) -> None:
        problems: list[str] = []
        check_range(problems, "prompt_tokens", self.prompt_tokens, 1)
        check_range(problems, "output_tokens", self.output_tokens, 1)
        check_rate(problems, self.arrival_rate_per_s)
        raise_problems("random", problems)


class RandomWorkload(Generator):
    """No reuse: i.i.d. uniformly random prompts (parameters: :class:`RandomParams`).

    Two prompts share a first chunk of ``C`` tokens with probability ``vocab_size**-C``: never,
    in practice. ``group`` is ``""``. Default ``num_requests``: 64.
    """

    name = "random"
    params_type = RandomParams

    def _prompts(self) -> Iterator[tuple[np.ndarray, int, str]]:
        p = self.params
        for index in range(self.num_requests):
            rng = self._rng(REQUEST, index)
            yield self._tokens(rng, p.prompt_tokens), self._output_tokens(rng, p.output_tokens), ""
