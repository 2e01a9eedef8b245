"""Credentials shared by the cache server and its clients: the client and admin tokens.

Every request but ``ping`` carries a token (``auth``). The server holds two:

- the **client token**, for connectors, tools and runs: cache operations on their own
  sessions, reservations and pins, statistics;
- the **admin token**, for administration (``drop_objects``, anything that changes other
  clients' data); it also works wherever the client token does.

A server keeps them in a *token file* (JSON, mode 0600) whose path its readiness line prints;
clients read it (``kvtb.token_file``, ``KVTB_TOKEN_FILE``) or get the token directly
(``kvtb.token``, ``KVTB_TOKEN``). See ``server.auth`` for the server's side.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

TOKEN_ENV = "KVTB_TOKEN"
"""Environment variable: the client token (servers: use it; clients: send it)."""
ADMIN_TOKEN_ENV = "KVTB_ADMIN_TOKEN"
"""Environment variable: the admin token."""
TOKEN_FILE_ENV = "KVTB_TOKEN_FILE"
"""Environment variable: a token file to read (clients) or keep the tokens in (servers)."""

_TOKEN_BYTES = 24


@dataclass(frozen=True)
class Credentials:
    client: str
    admin: str

    def __post_init__(self) -> None:
        if not self.client or not self.admin:
            raise ValueError("tokens must not be empty")
        if self.client == self.admin:
            raise ValueError("the client and admin tokens must differ")

    @classmethod
    def generate(cls) -> Credentials:
        return cls(secrets.token_hex(_TOKEN_BYTES), secrets.token_hex(_TOKEN_BYTES))

    def is_client(self, token: str) -> bool:
        return _same(token, self.client) or self.is_admin(token)

    def is_admin(self, token: str) -> bool:
        return _same(token, self.admin)

    def to_json(self) -> str:
        return json.dumps({"client": self.client, "admin": self.admin})


def _same(given: str, expected: str) -> bool:
    return bool(given) and hmac.compare_digest(given.encode(), expected.encode())


def read_token_file(path: Path | str) -> Credentials:
    """The tokens in a token file; a clear error if it is missing or not one."""
    path = Path(path)
    try:
        values = json.loads(path.read_text())
        return Credentials(str(values["client"]), str(values["admin"]))
    except FileNotFoundError:
        raise ValueError(f"token file {path} does not exist") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"token file {path} is not a kvtb token file: {exc}") from None


def client_token(token: str | None = None, token_file: Path | str | None = None) -> str:
    """A client's token: explicit, else from a token file, else ``KVTB_TOKEN`` /
    ``KVTB_TOKEN_FILE``; empty when none is configured (the server will refuse)."""
    if token:
        return token
    if token_file:
        return read_token_file(token_file).client
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV]
    if os.environ.get(TOKEN_FILE_ENV):
        return read_token_file(os.environ[TOKEN_FILE_ENV]).client
    return ""


@dataclass(frozen=True)
class ServerEndpoint:
    """Where a cache server listens and the credentials to use it."""

    url: str
    token: str = ""
    admin_token: str = ""
    """Only for administration (fault injection, drops); empty when not held."""
