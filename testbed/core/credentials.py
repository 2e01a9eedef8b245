"""Credentials shared by the cache server and its clients: the client and admin tokens.

Every request but ``ping`` carries a token (``auth``). The server holds two:

- the **client token**, for connectors, tools and runs: cache operations on their own
  sessions, reservations and pins, statistics;
- the **admin token**, for administration (``drop_objects``, anything that changes other
  clients' data); it also works wherever the client token does.

A server keeps them in a *token file* (JSON, mode 0600) whose path its readiness line prints;
clients read it (``kvtb.token_file``, ``KVTB_TOKEN_FILE``) or get the token directly
(``kvtb.token``, ``KVTB_TOKEN``). See ``server.auth`` for the server's side.

Token files are treated like ssh keys: one that its group or others may read (or write) is
refused, with the ``chmod`` that fixes it. Every token, however it arrives, is checked when it
is read: :data:`TOKEN_MIN_CHARS` to :data:`TOKEN_MAX_CHARS` printable ASCII characters without
spaces (the protocol carries at most 256; a longer one would make every request undecodable).
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
TOKEN_MIN_CHARS = 16
TOKEN_MAX_CHARS = 256
"""Token lengths accepted (generated tokens have 48 hexadecimal characters)."""


@dataclass(frozen=True)
class Credentials:
    client: str
    admin: str

    def __post_init__(self) -> None:
        check_token(self.client, "the client token")
        check_token(self.admin, "the admin token")
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


def check_token(token: str, what: str) -> str:
    """``token`` if it is a well-formed token; else ``ValueError`` naming ``what``."""
    if not TOKEN_MIN_CHARS <= len(token) <= TOKEN_MAX_CHARS:
        raise ValueError(
            f"{what} has {len(token)} characters; a token has {TOKEN_MIN_CHARS} to "
            f"{TOKEN_MAX_CHARS} (a server generates 48)"
        )
    if not (token.isascii() and token.isprintable()) or any(c.isspace() for c in token):
        raise ValueError(f"{what} must be printable ASCII without spaces")
    return token


def check_private(path: Path) -> None:
    """``ValueError`` if ``path`` may be read or written by its group or others."""
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise ValueError(
            f"token file {path} is accessible by its group or others (mode {mode:04o}); "
            f"keep it private as an ssh key: chmod 600 {path}"
        )


def read_token_file(path: Path | str) -> Credentials:
    """The tokens in a token file; a clear error if it is missing, not one, readable by
    others, or holds a malformed token."""
    path = Path(path)
    try:
        check_private(path)
        values = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"token file {path} does not exist") from None
    except OSError as exc:
        raise ValueError(f"token file {path} cannot be read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"token file {path} is not a kvtb token file: {exc}") from None
    client = values.get("client") if isinstance(values, dict) else None
    admin = values.get("admin") if isinstance(values, dict) else None
    if not isinstance(client, str) or not isinstance(admin, str):
        raise ValueError(f"token file {path} is not a kvtb token file (no client/admin tokens)")
    try:
        return Credentials(client, admin)
    except ValueError as exc:
        raise ValueError(f"token file {path}: {exc}") from None


def client_token(token: str | None = None, token_file: Path | str | None = None) -> str:
    """A client's token: explicit, else from a token file, else ``KVTB_TOKEN`` /
    ``KVTB_TOKEN_FILE``; empty when none is configured (the server will refuse)."""
    if token:
        return check_token(token, "the token")
    if token_file:
        return read_token_file(token_file).client
    if os.environ.get(TOKEN_ENV):
        return check_token(os.environ[TOKEN_ENV], TOKEN_ENV)
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
