"""The server's side of authentication: its tokens, their 0600 file, and ZeroMQ CURVE.

The embedded default: the server draws a client and an admin token at random when it starts
and writes them to a token file (mode 0600, beside its pool) whose path the readiness line
prints; launchers read it and pass the tokens on (``testbed.credentials``). ``--token-file
PATH`` keeps the tokens in a file of your choosing (created if missing, reused if present: a
restarted server keeps its clients' credentials). ``KVTB_TOKEN`` / ``KVTB_ADMIN_TOKEN`` set
them explicitly.

Beyond loopback, tokens would travel in clear text; binding another interface therefore
requires ZeroMQ CURVE (``--curve-dir``: the server's key pair ``server.key_secret`` and the
allowed clients' public keys ``*.key``, as made by ``zmq.auth.create_certificates``), which
encrypts and authenticates every connection.
"""

from __future__ import annotations

import os
from pathlib import Path

from testbed.credentials import ADMIN_TOKEN_ENV, TOKEN_ENV, Credentials, read_token_file

__all__ = ["Credentials", "is_loopback", "server_credentials", "write_token_file"]


def write_token_file(path: Path, credentials: Credentials) -> None:
    """Writes the tokens to ``path``, readable by this user only (0600)."""
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(credentials.to_json())
    tmp.replace(path)


def server_credentials(token_file: Path | None) -> Credentials:
    """The server's tokens: from the environment, else from ``token_file`` if it exists,
    else new random ones (written to ``token_file`` by the caller)."""
    client, admin = os.environ.get(TOKEN_ENV), os.environ.get(ADMIN_TOKEN_ENV)
    if client or admin:
        generated = Credentials.generate()
        return Credentials(client or generated.client, admin or generated.admin)
    if token_file is not None and token_file.exists():
        return read_token_file(token_file)
    return Credentials.generate()


def is_loopback(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")
