"""kv-cache-tester's coding-agent conversations: one JSON file each, read and checked.

A file (format: ``shared/data/README.md``) holds ``block_size``, ``hash_id_scope`` and
``requests``: entries that are either a request (``type`` ``"n"`` or ``"s"``: non-streaming or
streaming) or a sub-agent (``type`` ``"subagent"``, its own ``requests`` timed from its own
start). :func:`read_conversation` turns a file into a :class:`Conversation`: its agents (the
conversation itself first, then its sub-agents, depth first in file order), each with its
calls. Anything malformed raises ``ValueError`` naming the file and the entry
(``requests[36].requests[2]``).

Groups: the conversation's own requests are in the group named by the file's stem
(``trace_0004``); a sub-agent's in its parent's group, :data:`GROUP_SEPARATOR`, its
``agent_id`` (``trace_0004/agent_001``). Ids are scoped to the file (``"local"``) unless the file
says ``"global"``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from testbed.workloads.block_trace import block_id_array, is_int, is_number

GROUP_SEPARATOR = "/"
"""Between a conversation's group and a sub-agent's ``agent_id`` in a sub-agent's group."""
REQUEST_TYPES = ("n", "s")
SUBAGENT = "subagent"
SCOPES = ("local", "global")


@dataclass(frozen=True, eq=False)
class Call:
    """One recorded request of an agent."""

    index: int
    """Its position among its agent's requests (0-based)."""
    t_s: float
    """When it was sent, seconds since its agent started."""
    input_tokens: int
    output_tokens: int
    hash_ids: np.ndarray
    """int64 ids of its complete blocks (``input_tokens // block_size`` of them)."""
    think_s: float | None
    """The client's delay before sending it (``think_time``), if recorded."""
    api_s: float | None
    """The server's time to answer it (``api_time``), if recorded."""
    tail_key: int
    """Its position among all requests of the file (names its own tail tokens)."""


@dataclass(frozen=True)
class Agent:
    """The conversation itself or one of its sub-agents."""

    group: str
    start_s: float
    """When it started, seconds since the conversation started."""
    calls: tuple[Call, ...]
    parent: int | None
    """Index of the spawning agent in :attr:`Conversation.agents` (``None``: the conversation)."""
    spawned_after: int
    """How many of the parent's requests precede the sub-agent's entry."""


@dataclass(frozen=True)
class Conversation:
    name: str
    """The file's stem."""
    block_tokens: int
    scope: int | None
    """The ids' namespace: derived from the name (``"local"``), ``None`` (``"global"``)."""
    agents: tuple[Agent, ...]


def conversation_files(path: Path) -> list[Path]:
    """``path`` itself, or the ``*.json`` files of a directory in name order."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ValueError(f"agentic trace not found: {path} (give a .json file or a directory)")
    files = sorted(p for p in path.glob("*.json") if p.is_file())
    if not files:
        raise ValueError(f"{path}: no .json conversation files in the directory")
    return files


def read_conversation(path: Path) -> Conversation:
    try:
        document = json.loads(path.read_bytes())
    except ValueError as error:
        raise ValueError(f"{path}: not a JSON conversation ({error})") from None
    if not isinstance(document, dict) or not isinstance(document.get("requests"), list):
        raise ValueError(f"{path}: not a conversation (a JSON object with a 'requests' list)")
    block_tokens: Any = document.get("block_size")
    if not is_int(block_tokens) or block_tokens < 1:
        raise ValueError(f"{path}: block_size must be an integer >= 1, got {block_tokens!r}")
    scope_kind = document.get("hash_id_scope", "local")
    if scope_kind not in SCOPES:
        raise ValueError(f"{path}: hash_id_scope must be one of {SCOPES}, got {scope_kind!r}")
    name = path.stem
    scope = None
    if scope_kind == "local":
        scope = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") >> 1
    reader = _Reader(path, block_tokens)
    reader.agent(name, 0.0, document["requests"], "requests", None, 0)
    return Conversation(name, block_tokens, scope, tuple(reader.agents))


class _Reader:
    """Walks a file's entries, agent by agent, checking each."""

    def __init__(self, path: Path, block_tokens: int) -> None:
        self.path = path
        self.block_tokens = block_tokens
        self.agents: list[Agent] = []
        self.num_calls = 0

    def agent(
        self,
        group: str,
        start_s: float,
        entries: list[Any],
        where: str,
        parent: int | None,
        spawned_after: int,
    ) -> None:
        index = len(self.agents)
        self.agents.append(Agent(group, start_s, (), parent, spawned_after))
        calls: list[Call] = []
        names: set[str] = set()
        for position, entry in enumerate(entries):
            at = f"{where}[{position}]"
            kind = entry.get("type") if isinstance(entry, dict) else None
            if kind in REQUEST_TYPES:
                calls.append(self.call(entry, at, len(calls)))
            elif kind == SUBAGENT:
                agent_id = entry.get("agent_id")
                if not isinstance(agent_id, str) or not agent_id or GROUP_SEPARATOR in agent_id:
                    self.fail(at, f"agent_id must be a name without {GROUP_SEPARATOR!r}")
                if agent_id in names:
                    self.fail(at, f"agent_id {agent_id!r} appears twice")
                names.add(agent_id)
                if not isinstance(entry.get("requests"), list):
                    self.fail(at, "a sub-agent needs a 'requests' list")
                offset_s = self.seconds(entry, "t", at)
                child = f"{group}{GROUP_SEPARATOR}{agent_id}"
                self.agent(child, start_s + offset_s, entry["requests"], f"{at}.requests",
                           index, len(calls))  # fmt: skip
            else:
                self.fail(at, f"type must be one of {[*REQUEST_TYPES, SUBAGENT]}, got {kind!r}")
        self.agents[index] = Agent(group, start_s, tuple(calls), parent, spawned_after)

    def call(self, entry: dict[str, Any], at: str, index: int) -> Call:
        tokens: Any = entry.get("in")
        output: Any = entry.get("out")
        hash_ids = block_id_array(entry.get("hash_ids"))
        if not is_int(tokens) or tokens < 1:
            self.fail(at, f"in must be an integer >= 1, got {tokens!r}")
        if not is_int(output) or output < 0:
            self.fail(at, f"out must be an integer >= 0, got {output!r}")
        if hash_ids is None:
            self.fail(at, "hash_ids must be a list of integers >= 0")
        if len(hash_ids) != tokens // self.block_tokens:
            self.fail(
                at,
                f"{len(hash_ids)} hash_ids for in={tokens}; expected one per complete block: "
                f"{tokens} // {self.block_tokens} = {tokens // self.block_tokens}",
            )
        self.num_calls += 1
        return Call(
            index=index,
            t_s=self.seconds(entry, "t", at),
            input_tokens=tokens,
            output_tokens=output,
            hash_ids=hash_ids,
            think_s=self.seconds(entry, "think_time", at, required=False),
            api_s=self.seconds(entry, "api_time", at, required=False),
            tail_key=self.num_calls - 1,
        )

    def seconds(self, entry: dict[str, Any], key: str, at: str, *, required: bool = True) -> Any:
        value: Any = entry.get(key)
        if value is None and not required:
            return None
        if not is_number(value) or value < 0:
            self.fail(at, f"{key} must be a number of seconds >= 0, got {value!r}")
        return float(value)

    def fail(self, at: str, problem: str) -> NoReturn:
        raise ValueError(f"{self.path}: {at}: {problem}")
