"""Peer-to-peer between real cache servers: a lookup that misses on one server is served from
its peer's L1 (probe, fetch, copy into this server's pool), the worker loads the peer's exact
bytes, and a peer that is gone is a counted miss, never an error of the lookup."""

from __future__ import annotations

from collections.abc import Callable

from server.launch import ServerProcess
from testbed.core import protocol as p
from tests.support.cache_harness import BLOCK_SIZE, Harness, connect

StartServer = Callable[..., ServerProcess]
CHUNK = 64
TOKENS = [(17 * i + 3) % 30_000 for i in range(3 * CHUNK + 7)]
SOURCE_BLOCKS = list(range(0, 3 * CHUNK // BLOCK_SIZE + 1))
TARGET_BLOCKS = list(range(60, 60 + 3 * CHUNK // BLOCK_SIZE + 1))
STORED = 3 * CHUNK // BLOCK_SIZE  # blocks of the three complete chunks


def _servers(start_server: StartServer) -> tuple[ServerProcess, ServerProcess]:
    args = ("--chunk-size", str(CHUNK), "--capacity", "16MiB")
    return start_server(*args), start_server(*args)


def _peer(server: ServerProcess, *peers: ServerProcess) -> None:
    with connect(server, admin=True) as admin:
        admin.call(p.SetPeers(peers=[p.PeerEndpoint(url=x.url, token=x.token) for x in peers]))


def test_a_miss_here_is_loaded_from_the_peer_with_its_bytes(start_server: StartServer) -> None:
    a, b = _servers(start_server)
    _peer(a, b)
    _peer(b, a)
    with Harness(a, seed=1) as writer, Harness(b, seed=2) as reader:
        writer.prefill("w", TOKENS, SOURCE_BLOCKS)
        assert reader.stats().num_objects == 0
        loaded = reader.matched("r", TOKENS)
        assert loaded == 3 * CHUNK
        outcomes = reader.load(reader.allocate("r", TARGET_BLOCKS, loaded))
        reader.side.request_finished("r")
        assert not any(o.failed_block_ids for o in outcomes)
        stats = reader.stats()
        assert stats.num_objects == 3  # copied into b's own L1
        assert stats.peers is not None and stats.peers.chunks == 3 and stats.peers.peer_hits == 1
        served = writer.stats().peers
        assert served is not None and served.served_chunks == 3
        same = [
            blocks_equal_across(writer, reader, SOURCE_BLOCKS[k], TARGET_BLOCKS[k])
            for k in range(STORED)
        ]
        assert all(same)
        # A second lookup on b is an L1 hit there: the peer is not asked again.
        assert reader.matched("r2", TOKENS) == 3 * CHUNK
        reader.side.request_finished("r2")


def test_without_peers_the_same_lookup_misses(start_server: StartServer) -> None:
    a, b = _servers(start_server)
    with Harness(a, seed=1) as writer, Harness(b, seed=2) as reader:
        writer.prefill("w", TOKENS, SOURCE_BLOCKS)
        assert reader.matched("r", TOKENS) == 0
        reader.side.request_finished("r")


def test_a_peer_that_is_gone_is_a_miss_and_the_server_goes_on(start_server: StartServer) -> None:
    a, b = _servers(start_server)
    _peer(b, a)
    with Harness(b, seed=2, timeout_s=5.0) as reader:
        a.close()
        assert reader.matched("r", TOKENS) == 0
        reader.side.request_finished("r")
        peers = reader.stats().peers
        assert peers is not None and peers.probe_failures == 1 and peers.chunks == 0
        reader.prefill("own", TOKENS, SOURCE_BLOCKS)  # b still serves its own
        assert reader.matched("r2", TOKENS) == 3 * CHUNK
        reader.side.request_finished("r2")


def test_set_peers_needs_the_admin_token(start_server: StartServer) -> None:
    a, b = _servers(start_server)
    with connect(a) as client:
        reply = client.submit(p.SetPeers(peers=[p.PeerEndpoint(url=b.url, token=b.token)]))
        answer = reply.result(5.0)
    assert isinstance(answer, p.Error) and answer.code == "unauthorized"


def blocks_equal_across(writer: Harness, reader: Harness, source: int, target: int) -> bool:
    import torch

    return all(
        torch.equal(
            w.index_select(writer.ranks[0].kv.block_dim, torch.tensor([source])),
            r.index_select(reader.ranks[0].kv.block_dim, torch.tensor([target])),
        )
        for w, r in zip(writer.ranks[0].kv.layers, reader.ranks[0].kv.layers, strict=True)
    )




def test_a_peer_that_never_answers_costs_one_timeout_then_is_skipped(
    start_server: StartServer,
) -> None:
    import zmq

    _, b = _servers(start_server)
    silent = zmq.Context.instance().socket(zmq.ROUTER)  # a real endpoint that reads, never answers
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        _peer_urls(b, f"tcp://127.0.0.1:{port}")
        with Harness(b, seed=2, timeout_s=5.0) as reader:
            assert reader.matched("r", TOKENS) == 0  # answered after the peer's timeout
            reader.side.request_finished("r")
            assert reader.matched("r2", TOKENS) == 0  # the peer is down: not waited for again
            reader.side.request_finished("r2")
            peers = reader.stats().peers
            assert peers is not None and peers.probe_failures == 2 and peers.chunks == 0
            assert silent.poll(0)  # the first probe did reach it
    finally:
        silent.close(linger=0)


def _peer_urls(server: ServerProcess, *urls: str) -> None:
    with connect(server, admin=True) as admin:
        admin.call(p.SetPeers(peers=[p.PeerEndpoint(url=url, token="t") for url in urls]))
