"""Fault injection for experiments: drop a retrieve's first chunk just before it is read.

Runs in the worker of TP rank 0. For a chosen retrieve it asks the server (with the admin
token) to drop the objects of the op's first chunk on every rank, so the retrieve finds it
missing and the load-error path runs under vLLM's real recovery. The choice is a hash of the
seed, the chunk's key (which names the prompt up to it) and the attempt, not a random
stream nor the request id (which vLLM may decorate), so every engine, in any step order,
drops the same chunks of the same requests.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging

from connector.config import ConnectorConfig
from connector.ops import RetrieveOp
from testbed.core import protocol as p
from testbed.core.keys import ChunkHash
from testbed.core.rpc import CurveKeys, RemoteError, RpcClient, ServerUnavailable

log = logging.getLogger(__name__)


def chosen(fraction: float, seed: int, chunk_hash: ChunkHash, attempt: int) -> bool:
    """Whether a retrieve starting at chunk ``chunk_hash`` (in a request's ``attempt``) loses
    that chunk."""
    if fraction <= 0:
        return False
    key = seed.to_bytes(8, "little", signed=True) + attempt.to_bytes(4, "little") + chunk_hash
    digest = hashlib.blake2b(key, digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < fraction


class FaultInjector:
    """Drops the first chunk of chosen retrieves (context manager: owns an admin client)."""

    @classmethod
    def for_config(
        cls, config: ConnectorConfig, tp_rank: int, curve: CurveKeys | None
    ) -> FaultInjector | None:
        """The injector a connector's config asks for (``fault_drop_fraction``), on an admin
        connection of its own; ``None`` when it asks for none."""
        if not config.fault_drop_fraction:
            return None
        admin = RpcClient(
            config.server_url,
            role=f"faults{tp_rank}",
            token=config.admin_token,
            timeout_s=config.mq_timeout_s,
            curve=curve,
        )
        return cls(admin, config.fault_drop_fraction, config.fault_seed)

    def __init__(self, rpc: RpcClient, fraction: float, seed: int) -> None:
        self.rpc = rpc
        self.fraction = fraction
        self.seed = seed
        self.dropped = 0

    def before_retrieve(self, ops: list[RetrieveOp]) -> None:
        for op in ops:
            if op.chunk_hashes and chosen(self.fraction, self.seed, op.chunk_hashes[0], op.attempt):
                with contextlib.suppress(ServerUnavailable, RemoteError):  # gone: loads fail
                    self.rpc.call(p.DropObjects(chunk_hashes=op.chunk_hashes[:1], force=True))
                    self.dropped += 1

    def close(self) -> None:
        self.rpc.close()
