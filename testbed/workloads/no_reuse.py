"""``random``: independent uniformly random prompts, no reuse (a baseline)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated

import numpy as np

from testbed.workloads.generator import REQUEST, Generator
from testbed.workloads.params import Range, Rate, WorkloadParams


@dataclass(frozen=True)
class RandomParams(WorkloadParams, workload="random"):
    """Parameters of ``random``: independent uniformly random prompts."""

    prompt_tokens: Annotated[tuple[int, int], Range(1)] = (256, 4096)
    """Length range of each prompt."""

    output_tokens: Annotated[tuple[int, int], Range(1)] = (32, 256)
    """Length range of each answer."""

    arrival_rate_per_s: Annotated[float, Rate()] = 2.0
    """Poisson arrival rate of requests (``inf``: all at time 0)."""


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
