"""Document workloads: ``docqa`` (questions over long documents) and ``rag`` (retrieved
documents drawn by Zipf popularity from a pool)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from testbed.workloads.base import check_at_least, check_range, raise_problems
from testbed.workloads.generator import (
    DOCUMENT,
    QUESTION,
    REQUEST,
    SCHEDULE,
    SYSTEM,
    Generator,
    check_rate,
    interleave,
)


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
        check_rate(problems, self.arrival_rate_per_s)
        raise_problems("docqa", problems)


class DocQAWorkload(Generator):
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
        order = interleave(
            self._rng(SCHEDULE), self.num_documents, p.questions_per_document,
            p.concurrent_documents, self.num_requests,
        )  # fmt: skip
        for document, question_index in order:
            if document not in documents:
                documents[document] = self._tokens(self._rng(DOCUMENT, document), p.document_tokens)
            text = documents[document]
            if question_index + 1 == p.questions_per_document:
                del documents[document]
            rng = self._rng(QUESTION, document, question_index)
            prompt = np.concatenate([text, self._tokens(rng, p.question_tokens)])
            yield prompt, self._output_tokens(rng, p.output_tokens), f"doc-{document:05d}"


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
        check_rate(problems, self.arrival_rate_per_s)
        raise_problems("rag", problems)


class RAGWorkload(Generator):
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
        system = self._tokens(self._rng(SYSTEM), (p.system_prompt_tokens, p.system_prompt_tokens))
        weights = np.arange(1, p.num_documents + 1, dtype=np.float64) ** -p.zipf_alpha
        weights /= weights.sum()
        documents: dict[int, np.ndarray] = {}
        for index in range(self.num_requests):
            rng = self._rng(REQUEST, index)
            chosen = np.sort(
                rng.choice(p.num_documents, size=p.docs_per_request, replace=False, p=weights)
            )
            pieces = [system]
            for document in chosen.tolist():
                if document not in documents:
                    documents[document] = self._tokens(
                        self._rng(DOCUMENT, document), p.document_tokens
                    )
                pieces.append(documents[document])
            pieces.append(self._tokens(rng, p.question_tokens))
            yield np.concatenate(pieces), self._output_tokens(rng, p.output_tokens), ""
