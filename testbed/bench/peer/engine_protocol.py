"""What the driver and every benchmark engine process share, ours and the peer's alike.

This module imports only the standard library and numpy: the peer's engine runs it in the
peer's own environment, where the testbed is not installed (it imports it as a sibling
file). An engine process answers lines ``<length> <seed>`` on stdin with one JSON line on
stdout (``KVTB-E2E {...}``): both passes' time to first token, output tokens and lookup times.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import IO, Any

import numpy as np

RESULT = "KVTB-E2E "
"""Prefix of an engine's answer lines (vLLM logs to the same streams)."""
CHUNK = 256
BLOCK = 64
OUTPUT_TOKENS = 4


def prompt(seed: int, length: int, vocab: int) -> list[int]:
    """The prompt of one sample: the same in every configuration."""
    return [int(t) for t in np.random.default_rng(seed).integers(3, vocab, length)]


def answer(message: dict[str, object]) -> None:
    print(RESULT + json.dumps(message), flush=True)


def read_answer(stream: IO[str]) -> dict[str, Any]:
    for line in stream:
        if line.startswith(RESULT):
            reply: dict[str, Any] = json.loads(line[len(RESULT) :])
            return reply
    raise RuntimeError("a benchmark engine exited early (its log is in the bench's work folder)")


class LookupTimer:
    """Wraps a vLLM connector class's ``get_num_new_matched_tokens``: the seconds from a
    request's first call to the call that answers (the lookup as vLLM's scheduler waits for
    it) and the tokens it answered, whatever the connector. :meth:`take` returns and forgets
    the last request's."""

    def __init__(self) -> None:
        self._first: dict[str, float] = {}
        self._done: list[tuple[float, int]] = []

    def install(self, connector_class: type) -> None:
        original: Callable[..., Any] = connector_class.get_num_new_matched_tokens  # type: ignore[attr-defined]
        timer = self

        def timed(self: Any, request: Any, num_computed_tokens: int) -> Any:
            now = time.perf_counter()
            first = timer._first.setdefault(request.request_id, now)
            result = original(self, request, num_computed_tokens)
            if result[0] is not None:
                timer._done.append((time.perf_counter() - first, int(result[0])))
                timer._first.pop(request.request_id, None)
            return result

        setattr(connector_class, "get_num_new_matched_tokens", timed)  # noqa: B010

    def take(self) -> dict[str, float | int | None]:
        """``{"lookup_s": ..., "hit_tokens": ...}`` of the last answered lookup (``None``s:
        there was none, e.g. no connector)."""
        done, self._done = self._done, []
        seconds, tokens = done[-1] if done else (None, None)
        return {"lookup_s": seconds, "hit_tokens": tokens}
