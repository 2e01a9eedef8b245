"""The router's book of what it sent where, as routers without access to the engines keep it
(Dynamo's active-sequence tracking): per instance, the requests it sent there that have not
finished, their prompt tokens while they wait for their first token (*queued*: prefill still
to do) and their tokens once they produce (*running*: prompt and generated so far, the KV
they occupy). The book is told of every dispatch, first token and finish; it never reads an
engine, so a fleet of real servers keeps it the same way.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _InFlight:
    instance: int
    prompt_tokens: int
    producing: bool = False


class LoadBook:
    """Queued and running tokens per instance (see the module docstring)."""

    def __init__(self, num_instances: int) -> None:
        self.queued_tokens = [0] * num_instances
        self.running_tokens = [0] * num_instances
        self.requests = [0] * num_instances
        self._in_flight: dict[str, _InFlight] = {}

    def dispatched(self, request_id: str, instance: int, prompt_tokens: int) -> None:
        self._in_flight[request_id] = _InFlight(instance, prompt_tokens)
        self.queued_tokens[instance] += prompt_tokens
        self.requests[instance] += 1

    def first_token(self, request_id: str) -> None:
        entry = self._in_flight.get(request_id)
        if entry is None or entry.producing:
            return
        entry.producing = True
        self.queued_tokens[entry.instance] -= entry.prompt_tokens
        self.running_tokens[entry.instance] += entry.prompt_tokens

    def finished(self, request_id: str) -> None:
        entry = self._in_flight.pop(request_id, None)
        if entry is None:
            return
        if entry.producing:
            self.running_tokens[entry.instance] -= entry.prompt_tokens
        else:
            self.queued_tokens[entry.instance] -= entry.prompt_tokens
        self.requests[entry.instance] -= 1

    def load_tokens(self) -> list[int]:
        """Per instance, queued plus running tokens."""
        return [q + r for q, r in zip(self.queued_tokens, self.running_tokens, strict=True)]
