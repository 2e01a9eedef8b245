"""Coding-agent sessions (``agentic:PATH``): kv-cache-tester conversations replayed.

PATH is one conversation file or a directory of them (:mod:`.agentic_format`). Each
conversation is a *session*: its own requests and its sub-agents' (groups ``NAME`` and
``NAME/AGENT``), their tokens synthesised from the block ids (:mod:`.block_trace`: ids scoped
to the conversation, each request's tail its own). Two arrival modes (:class:`AgenticParams`):

- ``trace`` (no ``users``): every session starts at 0 and each request arrives at its recorded
  time, a sub-agent's at its parent's ``t`` plus its own;
- ``users=N``: N closed-loop users (:class:`~testbed.workloads.arrivals.ClosedLoop`), each
  replaying one session at a time, sessions in name order. A request arrives its *think time*
  after the previous request of its agent finished, on the engine's clock: the recorded
  ``think_time``, or where none is recorded the recorded gap between the previous request's
  answer (``t`` + ``api_time``) and this one's ``t``. A sub-agent starts the recorded gap after
  the parent request before it finished, and runs beside its parent (the parent's next
  request waits only for the parent's previous one, whose recorded think time already holds
  any wait for its sub-agents). Iteration order (what the oracle sees) is an engine that
  answers instantly.

Caps for small machines: ``max_input_tokens`` ends each agent before its first request longer
than that (a session keeps what came before in its file); ``max_sessions`` keeps a seeded
sample of that many sessions (of those with a request left); ``max_think_s`` caps every delay
of the closed loop (the traces hold pauses of days).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Annotated

import numpy as np

from testbed.workloads.agentic_format import (
    GROUP_SEPARATOR,
    Agent,
    Call,
    Conversation,
    conversation_files,
    read_conversation,
)
from testbed.workloads.arrivals import (
    ArrivalProcess,
    ClosedLoop,
    OpenLoop,
    Session,
    Step,
    T,
    instant_order,
)
from testbed.workloads.base import WorkloadOptions
from testbed.workloads.block_trace import BlockRequest, BlockTraceWorkload
from testbed.workloads.params import AtLeast, WorkloadParams, parse_params

__all__ = ["GROUP_SEPARATOR", "AgenticParams", "AgenticWorkload"]

_SAMPLE = 1  # what a seed of this module is for: the sample of sessions
COPY_SEPARATOR = "#"
"""Between a session's name and its copy's number (``trace_0004#3``)."""


@dataclass(frozen=True)
class AgenticParams(WorkloadParams, workload="agentic"):
    """Parameters of ``agentic:PATH`` (``--workload-param KEY=VALUE``)."""

    users: Annotated[int | None, AtLeast(1)] = None
    """Closed-loop users (arrival mode ``users``); ``None``: arrival mode ``trace``."""
    max_sessions: Annotated[int | None, AtLeast(1)] = None
    """Keep a seeded sample of this many sessions (``None``: all)."""
    max_input_tokens: Annotated[int | None, AtLeast(1)] = None
    """End each agent before its first request with more input tokens (``None``: no cap)."""
    max_think_s: Annotated[float | None, AtLeast(0.0)] = None
    """Cap on every closed-loop delay (think time, sub-agent start), seconds."""
    copies: Annotated[int, AtLeast(1)] = 1
    """Each session this many times (a corpus that many times larger): copy ``k`` > 0 is named
    ``NAME#k`` (its groups and request ids too) and its block ids are its own, as if it were
    another file (the copies' ids in a scope of their own; a global file's copies share their
    ids with each other as the originals do)."""

    @property
    def arrival_mode(self) -> str:
        return "trace" if self.users is None else "users"


@dataclass(frozen=True, eq=False)
class _Replay:
    """One session: its closed-loop plan and its requests (arrivals as recorded)."""

    session: Session
    requests: list[BlockRequest]


class AgenticWorkload(BlockTraceWorkload):
    """Requests of kv-cache-tester conversations (see the module docstring).

    ``num_requests`` keeps the first N requests of the iteration order (``None``: all).
    Request ids are ``GROUP-NNNN`` (the request's position in its agent); output lengths the
    recorded ``out`` capped by ``max_output_tokens``, and at least 1.
    """

    kind = "agentic"

    def __init__(
        self, path: str | Path, options: WorkloadOptions, params: AgenticParams = AgenticParams()
    ) -> None:
        self.path = Path(path)
        self.files = conversation_files(self.path)
        self.name = f"agentic:{path}"
        self.options = options
        self.params = params

    @classmethod
    def open(
        cls, path: str, options: WorkloadOptions, params: Mapping[str, object] | None
    ) -> AgenticWorkload:
        """The reader ``make_workload`` calls."""
        return cls(path, options, parse_params(AgenticParams, params, "agentic"))

    @property
    def closed_loop(self) -> bool:
        return self.params.users is not None

    def describe(self) -> dict[str, object]:
        digest = hashlib.sha256()
        for file in self.files:
            digest.update(
                f"{file.name}\0{hashlib.sha256(file.read_bytes()).hexdigest()}\0".encode()
            )
        return {
            "name": self.name,
            "kind": self.kind,
            "path": str(self.path),
            "files": len(self.files),
            "sha256": digest.hexdigest(),
            "num_requests": self.options.num_requests,
            "seed": self.options.seed,
            "vocab_size": self.options.vocab_size,
            "max_output_tokens": self.options.max_output_tokens,
            "arrival_mode": self.params.arrival_mode,
            **{key: getattr(self.params, key) for key in AgenticParams.__dataclass_fields__},
        }

    def block_requests(self) -> Iterator[BlockRequest]:
        limit = self.options.num_requests
        for index, request in enumerate(self._ordered()):
            if limit is not None and index >= limit:
                return
            yield request

    def arrival_process(self, requests: Sequence[T]) -> ArrivalProcess[T]:
        """How ``requests`` (some of this workload's, in its order) arrive at an engine."""
        if self.params.users is None:
            return OpenLoop(requests)
        items = {request.request_id: request for request in requests}
        return ClosedLoop([r.session for r in self._replays], self.params.users, items)

    def _ordered(self) -> Iterator[BlockRequest]:
        if self.params.users is None:
            every = [request for replay in self._replays for request in replay.requests]
            yield from sorted(every, key=lambda request: request.arrival_s)  # ties: file order
            return
        items = {r.request_id: r for replay in self._replays for r in replay.requests}
        sessions = [replay.session for replay in self._replays]
        yield from instant_order(ClosedLoop(sessions, self.params.users, items))

    @cached_property
    def _replays(self) -> list[_Replay]:
        conversations = [read_conversation(file) for file in self.files]
        replays = [
            replay
            for copy in range(self.params.copies)
            for conversation in conversations
            if (replay := _replay(_copy(conversation, copy), self.params, self.options)).requests
        ]
        if not replays:
            raise ValueError(
                f"{self.name}: no request left (max_input_tokens={self.params.max_input_tokens} "
                "is below every session's first request)"
            )
        wanted = self.params.max_sessions
        if wanted is not None and wanted < len(replays):
            rng = np.random.default_rng([self.options.seed, _SAMPLE])
            chosen = sorted(rng.choice(len(replays), size=wanted, replace=False).tolist())
            replays = [replays[index] for index in chosen]
        return replays


def _replay(conversation: Conversation, params: AgenticParams, options: WorkloadOptions) -> _Replay:
    """The session of ``conversation`` under the caps of ``params`` (module docstring)."""
    agents = conversation.agents
    kept = [_kept_calls(agent, params.max_input_tokens) for agent in agents]
    steps: list[Step] = []
    requests: list[BlockRequest] = []
    step_of: dict[tuple[int, int], int] = {}  # (agent, call) -> its step
    anchors: dict[int, tuple[tuple[int, ...], float]] = {}  # agent -> what its start waits for
    for number, agent in enumerate(agents):
        parent = agent.parent
        if parent is not None and (parent not in anchors or agent.spawned_after > kept[parent]):
            continue  # its entry comes after its parent's cut
        anchors[number] = after, done_s = _anchor(agents, number, anchors, step_of)
        for call in agent.calls[: kept[number]]:
            sent_s = agent.start_s + call.t_s
            if call.index == 0:  # the agent's start, then its own delay
                own_s = call.think_s if call.think_s is not None else call.t_s
                delay_s = max(0.0, agent.start_s - done_s) + own_s
            else:
                delay_s = call.think_s if call.think_s is not None else max(0.0, sent_s - done_s)
            if params.max_think_s is not None:
                delay_s = min(delay_s, params.max_think_s)
            step_of[number, call.index] = len(steps)
            steps.append(Step(f"{agent.group}-{call.index:04d}", after, delay_s))
            requests.append(
                BlockRequest(
                    request_id=steps[-1].request_id,
                    arrival_s=sent_s,
                    group=agent.group,
                    num_prompt_tokens=call.input_tokens,
                    max_output_tokens=options.cap_output(call.output_tokens),
                    block_ids=call.hash_ids,
                    block_tokens=conversation.block_tokens,
                    scope=conversation.scope,
                    tail_key=call.tail_key,
                )
            )
            after, done_s = (len(steps) - 1,), sent_s + (call.api_s or 0.0)
    return _Replay(Session(conversation.name, tuple(steps)), requests)


def _copy(conversation: Conversation, copy: int) -> Conversation:
    """Copy ``copy`` of ``conversation`` under new ids (``AgenticParams.copies``); copy 0 is
    the conversation itself."""
    if copy == 0:
        return conversation
    name = f"{conversation.name}{COPY_SEPARATOR}{copy}"
    agents = tuple(
        replace(agent, group=name + agent.group[len(conversation.name) :])
        for agent in conversation.agents
    )
    seed = name if conversation.scope is not None else f"{COPY_SEPARATOR}{copy}"
    scope = int.from_bytes(hashlib.sha256(seed.encode()).digest()[:8], "little") >> 1
    return replace(conversation, name=name, scope=scope, agents=agents)


def _anchor(
    agents: Sequence[Agent],
    number: int,
    anchors: Mapping[int, tuple[tuple[int, ...], float]],
    step_of: Mapping[tuple[int, int], int],
) -> tuple[tuple[int, ...], float]:
    """What agent ``number``'s first request waits for, and when that was done as recorded:
    the session's start, or the parent's request before the sub-agent's entry (its answer)."""
    agent = agents[number]
    if agent.parent is None:
        return (), 0.0
    if agent.spawned_after == 0:
        return anchors[agent.parent]
    parent = agents[agent.parent]
    call: Call = parent.calls[agent.spawned_after - 1]
    answered_s = parent.start_s + call.t_s + (call.api_s or 0.0)
    return (step_of[agent.parent, call.index],), answered_s


def _kept_calls(agent: Agent, max_input_tokens: int | None) -> int:
    """How many of the agent's requests come before its first one over the cap."""
    if max_input_tokens is None:
        return len(agent.calls)
    for call in agent.calls:
        if call.input_tokens > max_input_tokens:
            return call.index
    return len(agent.calls)
