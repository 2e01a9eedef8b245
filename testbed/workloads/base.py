"""What every workload yields and promises, and the options all of them take (a workload's
own parameters: :mod:`.params`).

A workload is an iterable of :class:`WorkloadRequest` in arrival order. Iteration is lazy (a
trace is streamed, a generator builds each prompt when it is reached) and deterministic: the
same options give identical requests on every iteration, on every machine.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from testbed.core.keys import KeyExtras, MultiModalInput
from testbed.models.servable import ServableShape


@dataclass(frozen=True, slots=True, eq=False)
class WorkloadRequest:
    """One request of a workload.

    ``eq=False``: the prompt is an array, so field-wise ``==`` would be ambiguous; compare
    prompts with ``np.array_equal``.
    """

    request_id: str
    """Unique within the workload, e.g. ``"chat-00017"``."""

    prompt_token_ids: np.ndarray
    """1-D ``int32`` token ids, at least one, each in ``[0, vocab_size)`` of the workload."""

    max_output_tokens: int
    """Tokens to generate (>= 1)."""

    arrival_s: float
    """Seconds since the workload start; non-decreasing in iteration order."""

    group: str = ""
    """Conversation or document the request belongs to, for analysis (``""`` when none)."""

    lora_adapter: str | None = None
    """The LoRA adapter the request runs under (``None``: the base model); it keys the KV."""

    mm_inputs: tuple[MultiModalInput, ...] = ()
    """Multimodal items behind placeholder tokens of the prompt (content hash and position);
    they key the KV of the chunks they overlap."""

    def __post_init__(self) -> None:
        tokens = self.prompt_token_ids
        if not isinstance(tokens, np.ndarray) or tokens.ndim != 1 or tokens.dtype != np.int32:
            raise ValueError(f"{self.request_id}: prompt_token_ids must be a 1-D int32 array")
        if tokens.size == 0:
            raise ValueError(f"{self.request_id}: prompt_token_ids is empty")
        if not self.request_id:
            raise ValueError("request_id must not be empty")
        if self.max_output_tokens < 1:
            raise ValueError(
                f"{self.request_id}: max_output_tokens must be >= 1, got {self.max_output_tokens}"
            )
        if not (math.isfinite(self.arrival_s) and self.arrival_s >= 0):
            raise ValueError(
                f"{self.request_id}: arrival_s must be finite and >= 0, got {self.arrival_s}"
            )

        if any(item.offset + item.length > tokens.size for item in self.mm_inputs):
            raise ValueError(f"{self.request_id}: a multimodal input ends past the prompt")
        KeyExtras(mm_inputs=self.mm_inputs)  # validates their order

    @property
    def num_prompt_tokens(self) -> int:
        return int(self.prompt_token_ids.size)

    @property
    def key_extras(self) -> KeyExtras | None:
        """What besides the prompt's tokens keys its chunks (``testbed.core.keys``)."""
        if self.lora_adapter is None and not self.mm_inputs:
            return None
        lora = None if self.lora_adapter is None else lora_identity(self.lora_adapter)
        return KeyExtras(lora=lora, mm_inputs=self.mm_inputs)


def lora_identity(name: str) -> tuple[str, str]:
    """The ``(name, path)`` a workload's LoRA adapter is known by: vLLM keys KV by both, and a
    replay loads no weights, so the path is a stable stand-in derived from the name."""
    return name, f"replay://lora/{name}"


class RequestShape(ServableShape, Protocol):
    """What a run needs of a request before its tokens: a :class:`WorkloadRequest`, or a
    block-hash trace's request as block ids (``testbed.workloads.block_trace``): what the
    servable filter reads, and when it arrives in which group."""

    @property
    def arrival_s(self) -> float: ...
    @property
    def group(self) -> str: ...


@runtime_checkable
class Workload(Protocol):
    """A named, re-iterable, deterministic stream of requests in arrival order."""

    @property
    def name(self) -> str:
        """``"chat"``, ``"mooncake:conversation_trace.jsonl"``, ... (the spec it was made from)."""
        ...

    def __iter__(self) -> Iterator[WorkloadRequest]: ...

    def describe(self) -> dict[str, object]:
        """Every parameter that determines the requests (JSON-serialisable, for spec.json)."""
        ...


@dataclass(frozen=True)
class WorkloadOptions:
    """Options every workload takes (the keyword arguments of ``make_workload``)."""

    num_requests: int | None = None
    """Requests to yield. ``None``: the whole trace, or the generator's documented default."""

    seed: int = 0
    """Seeds every random draw (token content, lengths, arrivals)."""

    vocab_size: int = 32000
    """Token ids are drawn from ``[0, vocab_size)``."""

    max_output_tokens: int | None = None
    """Caps each request's output length (``None``: no cap)."""

    def __post_init__(self) -> None:
        problems = []
        if self.num_requests is not None and self.num_requests < 1:
            problems.append(f"num_requests must be >= 1 or None, got {self.num_requests}")
        if self.seed < 0:
            problems.append(f"seed must be >= 0, got {self.seed}")
        if self.vocab_size < 2:
            problems.append(f"vocab_size must be >= 2, got {self.vocab_size}")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            problems.append(f"max_output_tokens must be >= 1 or None, got {self.max_output_tokens}")
        if problems:
            raise ValueError("invalid workload options: " + "; ".join(problems))

    def cap_output(self, num_tokens: int) -> int:
        """``num_tokens`` limited by ``max_output_tokens`` (and at least 1)."""
        if self.max_output_tokens is not None:
            num_tokens = min(num_tokens, self.max_output_tokens)
        return max(1, num_tokens)


def poisson_arrivals_s(
    rng: np.random.Generator, num_requests: int, rate_per_s: float
) -> np.ndarray:
    """Arrival times of a Poisson process at ``rate_per_s``, the first at 0.

    An infinite rate puts every request at 0 (an offline batch).
    """
    if math.isinf(rate_per_s):
        return np.zeros(num_requests)
    gaps_s = rng.exponential(1.0 / rate_per_s, size=num_requests)
    gaps_s[0] = 0.0
    return np.cumsum(gaps_s)
