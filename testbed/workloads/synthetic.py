"""Seeded workload generators: shared-prefix chat, long-document QA, Zipf RAG, no-reuse random.

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
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from testbed.workloads.base import (
    WorkloadOptions,
    WorkloadRequest,
    check_at_least,
    check_range,
    poisson_arrivals_s,
    raise_problems,
)

# Stream tags: the second seed word, so that e.g. question 3 of conversation 5 and document 5's
# third block never share a random stream.
_SYSTEM, _QUESTION, _ANSWER, _DOCUMENT, _REQUEST, _ARRIVALS, _SCHEDULE = range(7)


def _check_rate(problems: list[str], rate_per_s: float) -> None:
    if not rate_per_s > 0:
        problems.append(f"arrival_rate_per_s must be > 0 (inf: all at time 0), got {rate_per_s}")


class _Generator:
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

    def _resolve_grouped(self, groups_param: str, per_group_param: str) -> tuple[int, int]:
        """``(num_requests, num_groups)`` for a workload of groups of ``per_group_param`` items
        (turns of a conversation, questions about a document)."""
        num_groups: int | None = getattr(self.params, groups_param)
        per_group: int = getattr(self.params, per_group_param)
        if num_groups is None:
            num_requests = self.options.num_requests or self.default_num_requests
            return num_requests, math.ceil(num_requests / per_group)
        num_requests = self.options.num_requests or num_groups * per_group
        if num_requests > num_groups * per_group:
            raise ValueError(
                f"{self.name}: num_requests {num_requests} exceeds {groups_param} x "
                f"{per_group_param} = {num_groups} x {per_group}; raise {groups_param} or leave "
                "it unset"
            )
        return num_requests, num_groups

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
            self._rng(_ARRIVALS), self.num_requests, self.params.arrival_rate_per_s
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
        return rng.integers(0, self.options.vocab_size, _draw(rng, bounds), dtype=np.int32)

    def _output_tokens(self, rng: np.random.Generator, bounds: tuple[int, int]) -> int:
        return self.options.cap_output(_draw(rng, bounds))


def _draw(rng: np.random.Generator, bounds: tuple[int, int]) -> int:
    return int(rng.integers(bounds[0], bounds[1] + 1))


def _interleave(
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


# -------------------------------------------------------------------------------------------
# chat
# -------------------------------------------------------------------------------------------


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
        _check_rate(problems, self.arrival_rate_per_s)
        raise_problems("chat", problems)


class ChatWorkload(_Generator):
    """Shared system prompt + multi-turn chat (parameters: :class:`ChatParams`).

    Turn ``k`` of a conversation is ``system prompt + (question_j + answer_j for j < k) +
    question_k``: a strict prefix extension of turn ``k-1``'s prompt plus its output. Answers are
    synthesised (capped by ``max_output_tokens``), not taken from the engine. Turns of one
    conversation arrive in order; open conversations interleave (see ``_interleave``).
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
        system = self._tokens(self._rng(_SYSTEM), (p.system_prompt_tokens, p.system_prompt_tokens))
        history: dict[int, np.ndarray] = {}
        order = _interleave(
            self._rng(_SCHEDULE), self.num_conversations, p.turns, p.concurrent_conversations,
            self.num_requests,
        )  # fmt: skip
        for conversation, turn in order:
            question = self._tokens(self._rng(_QUESTION, conversation, turn), p.question_tokens)
            prompt = np.concatenate([history.pop(conversation, system), question])
            answer_rng = self._rng(_ANSWER, conversation, turn)
            num_output_tokens = self._output_tokens(answer_rng, p.answer_tokens)
            if turn + 1 < p.turns:
                answer = answer_rng.integers(
                    0, self.options.vocab_size, num_output_tokens, dtype=np.int32
                )
                history[conversation] = np.concatenate([prompt, answer])
            yield prompt, num_output_tokens, f"conv-{conversation:05d}"


# -------------------------------------------------------------------------------------------
# docqa
# -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DocQAParams:
    """Parameters of ``docqa``: several questions about each of a pool of long documents."""

    document_tokens: tuple[int, int] = (8192, 16384)
    """Length range of each document."""

    questions_per_document: int = 4
    """Questions asked about each document."""

    num_documents: int | None = None
    """Documents; ``None``: ``ceil(num_requests / questions_per_document)``."""

    concurrent_documents: int = 4
    """Documents being asked about at once (bounds the distance between their questions)."""

    question_tokens: tuple[int, int] = (16, 128)
    """Length range of each question."""

    output_tokens: tuple[int, int] = (32, 256)
    """Length range of each answer."""

    arrival_rate_per_s: float = 2.0
    """Poisson arrival rate of requests (``inf``: all at time 0)."""

    def __post_init__(self) -> None:
        problems: list[str] = []
        check_range(problems, "document_tokens", self.document_tokens, 1)
        check_at_least(problems, "questions_per_document", self.questions_per_document, 1)
        check_at_least(problems, "num_documents", self.num_documents, 1)
        check_at_least(problems, "concurrent_documents", self.concurrent_documents, 1)
        check_range(problems, "question_tokens", self.question_tokens, 1)
        check_range(problems, "output_tokens", self.output_tokens, 1)
        _check_rate(problems, self.arrival_rate_per_s)
        raise_problems("docqa", problems)


class DocQAWorkload(_Generator):
    """Long-document QA (parameters: :class:`DocQAParams`).

    Prompt = document + question; a document's questions arrive in order, interleaved with those
    of the other open documents. ``group`` is ``"doc-NNNNN"``. Default ``num_requests``: 64.
    """

    name = "docqa"
    params_type = DocQAParams

    def _resolve_num_requests(self) -> int:
        num_requests, self.num_documents = self._resolve_grouped(
            "num_documents", "questions_per_document"
        )
        return num_requests

    def describe(self) -> dict[str, object]:
        description = super().describe()
        description["num_documents"] = self.num_documents
        return description

    def _prompts(self) -> Iterator[tuple[np.ndarray, int, str]]:
        p = self.params
        documents: dict[int, np.ndarray] = {}  # open documents only
        order = _interleave(
            self._rng(_SCHEDULE), self.num_documents, p.questions_per_document,
            p.concurrent_documents, self.num_requests,
        )  # fmt: skip
        for document, question_index in order:
            if document not in documents:
                documents[document] = self._tokens(
                    self._rng(_DOCUMENT, document), p.document_tokens
                )
            text = documents[document]
            if question_index + 1 == p.questions_per_document:
                del documents[document]
            rng = self._rng(_QUESTION, document, question_index)
            prompt = np.concatenate([text, self._tokens(rng, p.question_tokens)])
            yield prompt, self._output_tokens(rng, p.output_tokens), f"doc-{document:05d}"


# -------------------------------------------------------------------------------------------
# rag
# -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RAGParams:
    """Parameters of ``rag``: retrieved documents drawn by Zipf popularity from a pool."""

    num_documents: int = 128
    """Documents in the pool."""

    docs_per_request: int = 4
    """Documents retrieved into each prompt (distinct)."""

    zipf_alpha: float = 1.0
    """Popularity exponent: document of rank ``r`` (1 = most popular) has weight ``r**-alpha``
    (0: uniform)."""

    system_prompt_tokens: int = 256
    """Tokens of the system prompt every request starts with (0: none)."""

    document_tokens: tuple[int, int] = (256, 1024)
    """Length range of each document."""

    question_tokens: tuple[int, int] = (16, 128)
    """Length range of each question."""

    output_tokens: tuple[int, int] = (32, 256)
    """Length range of each answer."""

    arrival_rate_per_s: float = 2.0
    """Poisson arrival rate of requests (``inf``: all at time 0)."""

    def __post_init__(self) -> None:
        problems: list[str] = []
        check_at_least(problems, "num_documents", self.num_documents, 1)
        check_at_least(problems, "docs_per_request", self.docs_per_request, 1)
        if self.docs_per_request > self.num_documents:
            problems.append(
                f"docs_per_request ({self.docs_per_request}) must not exceed num_documents "
                f"({self.num_documents})"
            )
        check_at_least(problems, "zipf_alpha", self.zipf_alpha, 0.0)
        check_at_least(problems, "system_prompt_tokens", self.system_prompt_tokens, 0)
        check_range(problems, "document_tokens", self.document_tokens, 1)
        check_range(problems, "question_tokens", self.question_tokens, 1)
        check_range(problems, "output_tokens", self.output_tokens, 1)
        _check_rate(problems, self.arrival_rate_per_s)
        raise_problems("rag", problems)


class RAGWorkload(_Generator):
    """RAG over a document pool (parameters: :class:`RAGParams`).

    Prompt = system prompt + ``docs_per_request`` distinct documents + question. Documents are
    drawn without replacement with Zipf weights and placed most popular first (document id =
    popularity rank - 1), so popular documents form shared prefixes. ``group`` is ``""``.
    Default ``num_requests``: 64.
    """

    name = "rag"
    params_type = RAGParams

    def _prompts(self) -> Iterator[tuple[np.ndarray, int, str]]:
        p = self.params
        system = self._tokens(self._rng(_SYSTEM), (p.system_prompt_tokens, p.system_prompt_tokens))
        weights = np.arange(1, p.num_documents + 1, dtype=np.float64) ** -p.zipf_alpha
        weights /= weights.sum()
        documents: dict[int, np.ndarray] = {}
        for index in range(self.num_requests):
            rng = self._rng(_REQUEST, index)
            chosen = np.sort(
                rng.choice(p.num_documents, size=p.docs_per_request, replace=False, p=weights)
            )
            pieces = [system]
            for document in chosen.tolist():
                if document not in documents:
                    documents[document] = self._tokens(
                        self._rng(_DOCUMENT, document), p.document_tokens
                    )
                pieces.append(documents[document])
            pieces.append(self._tokens(rng, p.question_tokens))
            yield np.concatenate(pieces), self._output_tokens(rng, p.output_tokens), ""


# -------------------------------------------------------------------------------------------
# random
# -------------------------------------------------------------------------------------------


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
        _check_rate(problems, self.arrival_rate_per_s)
        raise_problems("random", problems)


class RandomWorkload(_Generator):
    """No reuse: i.i.d. uniformly random prompts (parameters: :class:`RandomParams`).

    Two prompts share a first chunk of ``C`` tokens with probability ``vocab_size**-C``: never,
    in practice. ``group`` is ``""``. Default ``num_requests``: 64.
    """

    name = "random"
    params_type = RandomParams

    def _prompts(self) -> Iterator[tuple[np.ndarray, int, str]]:
        p = self.params
        for index in range(self.num_requests):
            rng = self._rng(_REQUEST, index)
            yield self._tokens(rng, p.prompt_tokens), self._output_tokens(rng, p.output_tokens), ""


GENERATORS: dict[str, type[_Generator]] = {
    cls.name: cls for cls in (ChatWorkload, DocQAWorkload, RAGWorkload, RandomWorkload)
}
