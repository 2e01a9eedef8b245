"""Engines read the run's spec: no engine spec holds a run key of its own (so none can drift
from ``RunSpec``'s default), the connector's settings come from the spec in one place, and a
run resolves what the spec leaves to the workload."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from testbed.core.credentials import ServerEndpoint
from testbed.engine.engine_spec import EngineSpec, connector_config
from testbed.engine.replay_spec import ReplaySpec
from testbed.engine.serve_launch import LaunchSpec
from testbed.run.servable import engine_spec
from testbed.spec.runspec import RunSpec
from testbed.workloads import WorkloadRequest

RESOLVED = {"engine_blocks"}
"""Run keys an engine spec holds resolved (the spec's value, or one from the workload)."""
SERVER = ServerEndpoint("tcp://127.0.0.1:5999", "client-token", "admin-token")


def _field_names(kind: type) -> set[str]:
    return {f.name for f in dataclasses.fields(kind)}


def test_no_engine_spec_holds_a_run_key_of_its_own():
    pytest.importorskip("torch", reason="the vllm engine's module writes models with torch")
    from testbed.engine.vllm_engine import VllmEngineSpec

    run_keys = set(RunSpec.keys())
    for kind in (EngineSpec, ReplaySpec, VllmEngineSpec, LaunchSpec):
        assert "run" in _field_names(kind)
        assert _field_names(kind) & run_keys == RESOLVED, kind


def test_the_connector_settings_are_the_run_specs():
    spec = RunSpec(
        chunk_size=128,
        server_timeout_s=7.0,
        load_async=False,
        store_wait=False,
        transfer_mode="server",
        fault_drop_fraction=0.25,
        seed=3,
    )
    config = connector_config(spec, SERVER, engine_id="e", model_name="m", mla=True)
    assert (config.server_url, config.token, config.engine_id) == (SERVER.url, "client-token", "e")
    assert (config.chunk_size, config.mq_timeout_s, config.load_async) == (128, 7.0, False)
    assert (config.lookup_wait_s, config.load_wait_s, config.store_wait_s) == (7.0, 7.0, 0.0)
    assert (config.transfer_mode, config.model_name, config.mla) == ("server", "m", True)
    assert (config.fault_drop_fraction, config.fault_seed) == (0.25, 3)
    assert config.admin_token == "admin-token"

    waits = connector_config(dataclasses.replace(spec, store_wait=True), SERVER, engine_id="e")
    assert waits.store_wait_s == 7.0
    polled = connector_config(spec, SERVER, engine_id="e", wait=False)
    assert (polled.lookup_wait_s, polled.load_wait_s, polled.store_wait_s) == (0.0, 0.0, 0.0)
    faultless = connector_config(spec, SERVER, engine_id="e", faults=False, token_file=None)
    assert (faultless.fault_drop_fraction, faultless.admin_token) == (0.0, "")


def test_a_launched_servers_connector_reads_its_token_from_the_file(tmp_path):
    config = connector_config(RunSpec(), SERVER, engine_id="e", token_file=tmp_path / "token")
    assert (config.token, config.token_file) == ("", str(tmp_path / "token"))


def test_a_run_resolves_the_pool_and_model_length_from_its_requests():
    requests = [WorkloadRequest("a", np.zeros(1000, np.int32), 24, 0.0)]
    sized = engine_spec(ReplaySpec, RunSpec(block_size=64), requests, log_stats=True)
    assert sized.run == RunSpec(block_size=64) and sized.log_stats
    assert sized.max_model_len == 1088  # 1,025 tokens in whole blocks of 64
    assert sized.engine_blocks == 2 * 16 + 1  # the longest request twice, and the null block
    given = engine_spec(ReplaySpec, RunSpec(engine_blocks=40), requests)
    assert given.engine_blocks == 40
    assert given.connector_engine_id == given.run.run_id


def test_of_splits_an_engines_own_fields_from_the_run_keys():
    spec = ReplaySpec.of(engine_blocks=40, max_model_len=2048, kv_events=True, block_size=32)
    assert (spec.engine_blocks, spec.max_model_len, spec.kv_events) == (40, 2048, True)
    assert spec.run == RunSpec(block_size=32)
