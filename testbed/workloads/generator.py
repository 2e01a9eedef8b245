"""What every seeded generator shares: per-content random streams, arrivals, interleaving.

Every piece of content (the system prompt, a question, an answer, a document, a random
prompt) draws its length and tokens from its own generator, seeded by ``(seed, stream, ids)``.
So a conversation's text does not change when the arrival rate, the interleaving or
``num_requests`` changes, and a different seed changes everything. Arrivals are a Poisson
process (``arrival_rate_per_s``; ``inf`` puts every request at time 0).

Ranges such as ``question_tokens`` are inclusive ``(min, max)`` pairs, drawn uniformly.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np

from testbed.workloads.base import (
    WorkloadOptions,
    WorkloadRequest,
    poisson_arrivals_s,
)

# Stream tags: the second seed word, so that e.g. question 3 of conversation 5 and document 5's
# third block never share a random stream.
SYSTEM, QUESTION, ANSWER, DOCUMENT, REQUEST, ARRIVALS, SCHEDULE = range(7)


class Generator:
    """Shared machinery: options, seeding, arrivals, request ids, ``describe``."""

    name: ClassVar[str]
    params_type: ClassVar[type[Any]]
    default_num_requests: ClassVar[int] = 64

    def __init__(self, options: WorkloadOptions, params: Any) -> None:
        self.options = options
        self.params = params
        self.num_requests = self._resolve_num_requests()

    def _resolve_num_requests(self) -> int:
        return self.options.num_requests or self.default_num_requests

    def describe(self) -> dict[str, object]:
        return {
            "name": self.name,
            "kind": "generator",
            "num_requests": self.num_requests,
            "seed": self.options.seed,
            "vocab_size": self.options.vocab_size,
            "max_output_tokens": self.options.max_output_tokens,
            "params": dataclasses.asdict(self.params),
        }

    def __iter__(self) -> Iterator[WorkloadRequest]:
        arrivals_s = poisson_arrivals_s(
            self._rng(ARRIVALS), self.num_requests, self.params.arrival_rate_per_s
        )
        for index, (prompt, num_output_tokens, group) in enumerate(self._prompts()):
            yield WorkloadRequest(
                request_id=f"{self.name}-{index:05d}",
                prompt_token_ids=prompt,
                max_output_tokens=num_output_tokens,
                arrival_s=float(arrivals_s[index]),
                group=group,
            )

    def _prompts(self) -> Iterator[tuple[np.ndarray, int, str]]:
        """``num_requests`` tuples of (prompt, output tokens, group), in arrival order."""
        raise NotImplementedError

    def _rng(self, *ids: int) -> np.random.Generator:
        return np.random.default_rng([self.options.seed, *ids])

    def _tokens(self, rng: np.random.Generator, bounds: tuple[int, int]) -> np.ndarray:
        """Random token ids, their count drawn from the inclusive ``bounds``."""
        return rng.integers(0, self.options.vocab_size, draw(rng, bounds), dtype=np.int32)

    def _output_tokens(self, rng: np.random.Generator, bounds: tuple[int, int]) -> int:
        return self.options.cap_output(draw(rng, bounds))

    def _system_prompt(self, num_tokens: int) -> np.ndarray:
        """The ``num_tokens`` of the system prompt every request or group starts with."""
        return self._tokens(self._rng(SYSTEM), (num_tokens, num_tokens))


class GroupedGenerator(Generator):
    """A generator of groups of items (a conversation's turns, a document's questions), at most
    ``concurrent`` groups open at a time (:func:`interleave`).

    Its params name the group count ``groups_param`` (``None``: as many as ``num_requests``
    needs), the items per group ``per_group_param`` and the open groups ``concurrent_param``;
    ``describe`` adds the resolved group count under ``groups_param``.
    """

    groups_param: ClassVar[str]
    per_group_param: ClassVar[str]
    concurrent_param: ClassVar[str]
    num_groups: int

    def _resolve_num_requests(self) -> int:
        """``num_requests``; sets ``num_groups``."""
        groups: int | None = getattr(self.params, self.groups_param)
        per_group: int = getattr(self.params, self.per_group_param)
        if groups is None:
            num_requests = self.options.num_requests or self.default_num_requests
            self.num_groups = math.ceil(num_requests / per_group)
            return num_requests
        num_requests = self.options.num_requests or groups * per_group
        if num_requests > groups * per_group:
            raise ValueError(
                f"{self.name}: num_requests {num_requests} exceeds {self.groups_param} x "
                f"{self.per_group_param} = {groups} x {per_group}; raise {self.groups_param} or "
                "leave it unset"
            )
        self.num_groups = groups
        return num_requests

    def describe(self) -> dict[str, object]:
        description = super().describe()
        description[self.groups_param] = self.num_groups
        return description

    def _order(self) -> Iterator[tuple[int, int]]:
        """``(group, item)`` pairs in arrival order (:func:`interleave`)."""
        return interleave(
            self._rng(SCHEDULE), self.num_groups, getattr(self.params, self.per_group_param),
            getattr(self.params, self.concurrent_param), self.num_requests,
        )  # fmt: skip


def draw(rng: np.random.Generator, bounds: tuple[int, int]) -> int:
    return int(rng.integers(bounds[0], bounds[1] + 1))


def interleave(
    rng: np.random.Generator, num_groups: int, items_per_group: int, concurrent: int, num_items: int
) -> Iterator[tuple[int, int]]:
    """``(group, item)`` pairs, each group's items in order.

    At most ``concurrent`` groups are open at a time; each step advances one open group chosen
    uniformly, and a finished group is replaced by the next unopened one. This bounds how far
    apart a conversation's turns (a document's questions) are, like users thinking between turns.
    """
    open_groups = list(range(min(concurrent, num_groups)))
    next_group = len(open_groups)
    progress = [0] * num_groups
    for _ in range(num_items):
        slot = int(rng.integers(len(open_groups)))
        group = open_groups[slot]
        yield group, progress[group]
        progress[group] += 1
        if progress[group] == items_per_group:
            if next_group < num_groups:
                open_groups[slot] = next_group
                next_group += 1
            else:
                open_groups.pop(slot)
