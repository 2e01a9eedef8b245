"""The server's side of authentication: its tokens, their 0600 file, and ZeroMQ CURVE.

The embedded default: the server draws a client and an admin token at random when it starts
and writes them to a token file (mode 0600, beside its pool) whose path the readiness line
prints; launchers read it and pass the tokens on (``testbed.core.credentials``). ``--token-file
PATH`` keeps the tokens in a file of your choosing (created if missing, reused if present: a
restarted server keeps its clients' credentials; refused if its group or others may read it).
``KVTB_TOKEN`` / ``KVTB_ADMIN_TOKEN`` set them explicitly. The server holds its token file's
owner lock while it runs (``testbed.core.owned_files``: how ``kvtb clean`` and other servers know
the file is live, in any PID namespace).

Beyond loopback, tokens would travel in clear text; binding another interface therefore
requires ZeroMQ CURVE (``--curve-dir``: the server's key pair ``server.key_secret`` and the
allowed clients' public keys ``*.key``, as made by ``zmq.auth.create_certificates``), which
encrypts and authenticates every connection.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import zmq

from testbed.core.credentials import (
    ADMIN_TOKEN_ENV,
    TOKEN_ENV,
    Credentials,
    check_token,
    read_token_file,
)
from testbed.core.owned_files import OwnerLock, create_locked

__all__ = [
    "Credentials",
    "hold_token_file",
    "is_loopback",
    "server_credentials",
    "start_curve",
]


@contextlib.contextmanager
def hold_token_file(path: Path, credentials: Credentials, *, keep: bool) -> Iterator[None]:
    """Holds the token file's owner lock while the server runs: an existing file (a kept
    ``--token-file``) as it is, else a new one holding ``credentials`` (0600, complete before
    it has its name). On exit the file is removed unless ``keep``."""
    try:
        if path.exists():
            owner = OwnerLock.hold(path)
        else:
            owner = create_locked(path, content=credentials.to_json().encode())
    except OSError as exc:
        raise ValueError(
            f"cannot write the token file {path}: {exc} (--token-file puts it elsewhere)"
        ) from None
    try:
        yield
    finally:
        if not keep:
            path.unlink(missing_ok=True)
        owner.close()


def server_credentials(token_file: Path | None) -> Credentials:
    """The server's tokens: from the environment, else from ``token_file`` if it exists,
    else new random ones (written to ``token_file`` by the caller)."""
    client, admin = os.environ.get(TOKEN_ENV), os.environ.get(ADMIN_TOKEN_ENV)
    if client or admin:
        for value, name in ((client, TOKEN_ENV), (admin, ADMIN_TOKEN_ENV)):
            if value:
                check_token(value, name)
        generated = Credentials.generate()
        return Credentials(client or generated.client, admin or generated.admin)
    if token_file is not None and token_file.exists():
        return read_token_file(token_file)
    return Credentials.generate()


def is_loopback(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")


def start_curve(context: zmq.Context, socket: zmq.Socket, curve_dir: Path | None) -> Any:
    """Makes ``socket`` a CURVE server admitting the public keys in ``curve_dir``; returns the
    running authenticator (stop it after the socket closes), or ``None`` without CURVE."""
    if curve_dir is None:
        return None
    from zmq.auth import load_certificate
    from zmq.auth.thread import ThreadAuthenticator

    secret_file = curve_dir / "server.key_secret"
    if not secret_file.is_file():
        raise ValueError(
            f"--curve-dir {curve_dir} has no server.key_secret (make one with "
            "zmq.auth.create_certificates(DIR, 'server'))"
        )
    public, secret = load_certificate(secret_file)
    authenticator = ThreadAuthenticator(context)
    authenticator.start()
    authenticator.configure_curve(domain="*", location=str(curve_dir))
    socket.curve_secretkey = secret
    socket.curve_publickey = public
    socket.curve_server = True
    return authenticator
