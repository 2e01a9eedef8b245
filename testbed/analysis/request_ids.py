"""Finding a request by any id a user has for it.

A request has several ids: vLLM's (the connector's, ``request_id``), the workload's (the
engine's request span, ``workload_request_id``), the session id (``"{engine_id}:{request_id}"``)
and, behind vLLM's OpenAI server, the one its client saw. The server answers with ``cmpl-X``
(``X`` the ``X-Request-Id`` header, or a fresh uuid) and vLLM runs the completion's choices as
``cmpl-X-<index>-<8 hex digits>`` (vLLM's input processor appends a random suffix to every
request it admits, the server the choice index before it): :func:`find_rows` accepts both.
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

ID_COLUMNS = ("request_id", "workload_request_id", "session_id")
"""The columns an exact id is looked up in, in this order."""
_VLLM_SUFFIX = re.compile(r"(?:-\d+)?-[0-9a-f]{8}")
"""What vLLM appends to a client-visible id: the choice index, then a random suffix."""


def find_rows(table: pd.DataFrame, request_id: str) -> list[int]:
    """The rows of ``table`` (an attribution table) that ``request_id`` names: an exact match
    in one of :data:`ID_COLUMNS` (the first column with one), else the requests vLLM ran for a
    client-visible id (every choice of the completion). ``[]`` when none."""
    wanted = str(request_id)
    for column in ID_COLUMNS:
        if column in table:
            matches = np.flatnonzero((table[column].astype(str) == wanted).to_numpy())
            if len(matches):
                return [int(i) for i in matches]
    internal = table["request_id"].astype(str)
    prefix = wanted + "-"
    extends = internal.map(
        lambda value: (
            value.startswith(prefix) and bool(_VLLM_SUFFIX.fullmatch(value[len(wanted) :]))
        )
    )
    return [int(i) for i in np.flatnonzero(extends.to_numpy())]


def examples(table: pd.DataFrame, count: int = 3) -> str:
    """A few ids of ``table``'s requests, for error messages (``chat-00000, chat-00001, …``)."""
    column = "workload_request_id" if table["workload_request_id"].notna().any() else "request_id"
    ids = [str(value) for value in table[column].dropna().head(count)]
    return ", ".join(ids) + (", …" if len(table) > count else "")
