"""Document workloads: ``docqa`` (questions over long documents) and ``rag`` (retrieved
documents drawn by Zipf popularity from a pool)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated

import numpy as np

from testbed.workloads.generator import DOCUMENT, QUESTION, REQUEST, Generator, GroupedGenerator
from testbed.workloads.params import AtLeast, NotAbove, Range, Rate, WorkloadParams


@dataclass(frozen=True)
class DocQAParams(WorkloadParams, workload="docqa"):
    """Parameters of ``docqa``: several questions about each of a pool of long documents."""

    document_tokens: Annotated[tuple[int, int], Range(1)] = (8192, 16384)
    """Length range of each document."""

    questions_per_document: Annotated[int, AtLeast(1)] = 4
    """Questions asked about each document."""

    num_documents: Annotated[int | None, AtLeast(1)] = None
    """Documents; ``None``: ``ceil(num_requests / questions_per_document)``."""

    concurrent_documents: Annotated[int, AtLeast(1)] = 4
    """Documents being asked about at once (bounds the distance between their questions)."""

    question_tokens: Annotated[tuple[int, int], Range(1)] = (16, 128)
    """Length range of each question."""

    output_tokens: Annotated[tuple[int, int], Range(1)] = (32, 256)
    """Length range of each answer."""

    arrival_rate_per_s: Annotated[float, Rate()] = 2.0
    """Poisson arrival rate of requests (``inf``: all at time 0)."""


class DocQAWorkload(GroupedGenerator):
    """Long-document QA (parameters: :class:`DocQAParams`).

    Prompt = document + question; a document's questions arrive in order, interleaved with those
    of the other open documents. ``group`` is ``"doc-NNNNN"``. Default ``num_requests``: 64.
    """

    name = "docqa"
    params_type = DocQAParams
    groups_param = "num_documents"
    per_group_param = "questions_per_document"
    concurrent_param = "concurrent_documents"

    def _prompts(self) -> Iterator[tuple[np.ndarray, int, str]]:
        p = self.params
        documents: dict[int, np.ndarray] = {}  # open documents only
        for document, question_index in self._order():
            if document not in documents:
                documents[document] = self._tokens(self._rng(DOCUMENT, document), p.document_tokens)
            text = documents[document]
            if question_index + 1 == p.questions_per_document:
                del documents[document]
            rng = self._rng(QUESTION, document, question_index)
            prompt = np.concatenate([text, self._tokens(rng, p.question_tokens)])
            yield prompt, self._output_tokens(rng, p.output_tokens), f"doc-{document:05d}"


@dataclass(frozen=True)
class RAGParams(WorkloadParams, workload="rag"):
    """Parameters of ``rag``: retrieved documents drawn by Zipf popularity from a pool."""

    num_documents: Annotated[int, AtLeast(1)] = 128
    """Documents in the pool."""

    docs_per_request: Annotated[int, AtLeast(1), NotAbove("num_documents")] = 4
    """Documents retrieved into each prompt (distinct)."""

    zipf_alpha: Annotated[float, AtLeast(0.0)] = 1.0
    """Popularity exponent: document of rank ``r`` (1 = most popular) has weight ``r**-alpha``
    (0: uniform)."""

    system_prompt_tokens: Annotated[int, AtLeast(0)] = 256
    """Tokens of the system prompt every request starts with (0: none)."""

    document_tokens: Annotated[tuple[int, int], Range(1)] = (256, 1024)
    """Length range of each document."""

    question_tokens: Annotated[tuple[int, int], Range(1)] = (16, 128)
    """Length range of each question."""

    output_tokens: Annotated[tuple[int, int], Range(1)] = (32, 256)
    """Length range of each answer."""

    arrival_rate_per_s: Annotated[float, Rate()] = 2.0
    """Poisson arrival rate of requests (``inf``: all at time 0)."""


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
        system = self._system_prompt(p.system_prompt_tokens)
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
