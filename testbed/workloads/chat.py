"""``chat``: multi-turn conversations behind one shared system prompt."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from testbed.workloads.base import check_at_least, check_range, raise_problems
from testbed.workloads.generator import (
    ANSWER,
    QUESTION,
    SCHEDULE,
    SYSTEM,
    Generator,
    check_rate,
    interleave,
)


@dataclass(frozen=True)
class ChatParams:
    """Parameters of ``chat``: multi-turn conversations behind one shared system prompt."""

    system_prompt_tokens: int = 1024
    """Tokens of the system prompt every conversation starts with (0: none)."""

    turns: int = 4
    """Turns per conversation."""

    num_conversations: int | None = None
    """Conversations; ``None``: ``ceil(num_requests / turns)``."""

    concurrent_conversations: int = 8
    """Conversations open at once (bounds the distance between a conversation's turns)."""

    question_tokens: tuple[int, int] = (32, 256)
    """Length range of each user question."""

    answer_tokens: tuple[int, int] = (64, 512)
    """Length range of each answer (the request's output tokens, appended to the next turn)."""

    arrival_rate_per_s: float = 2.0
    """Poisson arrival rate of requests (``inf``: all at time 0)."""

    def __post_init__(self) -> None:
        problems: list[str] = []
        check_at_least(problems, "system_prompt_tokens", self.system_prompt_tokens, 0)
        check_at_least(problems, "turns", self.turns, 1)
        check_at_least(problems, "num_conversations", self.num_conversations, 1)
        check_at_least(problems, "concurrent_conversations", self.concurrent_conversations, 1)
        check_range(problems, "question_tokens", self.question_tokens, 1)
        check_range(problems, "answer_tokens", self.answer_tokens, 1)
        check_rate(problems, self.arrival_rate_per_s)
        raise_problems("chat", problems)


class ChatWorkload(Generator):
    """Shared system prompt + multi-turn chat (parameters: :class:`ChatParams`).

    Turn ``k`` of a conversation is ``system prompt + (question_j + answer_j for j < k) +
    question_k``: a strict prefix extension of turn ``k-1``'s prompt plus its output. Answers are
    synthesised (capped by ``max_output_tokens``), not taken from the engine. Turns of one
    conversation arrive in order; open conversations interleave (see ``interleave``).
    ``group`` is ``"conv-NNNNN"``. Default ``num_requests``: 64.
    """

    name = "chat"
    params_type = ChatParams

    def _resolve_num_requests(self) -> int:
        num_requests, self.num_conversations = self._resolve_grouped("num_conversations", "turns")
        return num_requests

    def describe(self) -> dict[str, object]:
        description = super().describe()
        description["num_conversations"] = self.num_conversations
        return description

    def _prompts(self) -> Iterator[tuple[np.ndarray, int, str]]:
        p = self.params
        system = self._tokens(self._rng(SYSTEM), (p.system_prompt_tokens, p.system_prompt_tokens))
        history: dict[int, np.ndarray] = {}
        order = interleave(
            self._rng(SCHEDULE), self.num_conversations, p.turns, p.concurrent_conversations,
            self.num_requests,
        )  # fmt: skip
        for conversation, turn in order:
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
