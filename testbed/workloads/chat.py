"""``chat``: multi-turn conversations behind one shared system prompt."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated

import numpy as np

from testbed.workloads.generator import ANSWER, QUESTION, GroupedGenerator
from testbed.workloads.params import AtLeast, Range, Rate, WorkloadParams


@dataclass(frozen=True)
class ChatParams(WorkloadParams, workload="chat"):
    """Parameters of ``chat``: multi-turn conversations behind one shared system prompt."""

    system_prompt_tokens: Annotated[int, AtLeast(0)] = 1024
    """Tokens of the system prompt every conversation starts with (0: none)."""

    turns: Annotated[int, AtLeast(1)] = 4
    """Turns per conversation."""

    num_conversations: Annotated[int | None, AtLeast(1)] = None
    """Conversations; ``None``: ``ceil(num_requests / turns)``."""

    concurrent_conversations: Annotated[int, AtLeast(1)] = 8
    """Conversations open at once (bounds the distance between a conversation's turns)."""

    question_tokens: Annotated[tuple[int, int], Range(1)] = (32, 256)
    """Length range of each user question."""

    answer_tokens: Annotated[tuple[int, int], Range(1)] = (64, 512)
    """Length range of each answer (the request's output tokens, appended to the next turn)."""

    arrival_rate_per_s: Annotated[float, Rate()] = 2.0
    """Poisson arrival rate of requests (``inf``: all at time 0)."""


class ChatWorkload(GroupedGenerator):
    """Shared system prompt + multi-turn chat (parameters: :class:`ChatParams`).

    Turn ``k`` of a conversation is ``system prompt + (question_j + answer_j for j < k) +
    question_k``: a strict prefix extension of turn ``k-1``'s prompt plus its output. Answers are
    synthesised (capped by ``max_output_tokens``), not taken from the engine. Turns of one
    conversation arrive in order; open conversations interleave (see ``interleave``).
    ``group`` is ``"conv-NNNNN"``. Default ``num_requests``: 64.
    """

    name = "chat"
    params_type = ChatParams
    groups_param = "num_conversations"
    per_group_param = "turns"
    concurrent_param = "concurrent_conversations"

    def _prompts(self) -> Iterator[tuple[np.ndarray, int, str]]:
        p = self.params
        system = self._system_prompt(p.system_prompt_tokens)
        history: dict[int, np.ndarray] = {}
        for conversation, turn in self._order():
            question = self._tokens(self._rng(QUESTION, conversation, turn), p.question_tokens)
            prompt = np.concatenate([history.pop(conversation, system), question])
            answer_rng = self._rng(ANSWER, conversation, turn)
            num_output_tokens = self._output_tokens(answer_rng, p.answer_tokens)
            if turn + 1 < p.turns:
                answer = answer_rng.integers(
                    0, self.options.vocab_size, num_output_tokens, dtype=np.int32
                )
                history[conversation] = np.concatenate([prompt, answer])
            yield prompt, num_output_tokens, f"conv-{conversation:05d}"
