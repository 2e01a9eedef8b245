"""Four engines with different workloads sharing one small cache server at once.

Runs in the chaos process. The server's capacity is far below what the four runs store, so
it evicts all along; a watcher samples its stats every 50 ms: ``used_bytes`` must never
exceed ``capacity_bytes``, every retrieved byte must be right, and once the last run has
ended the server must hold nothing (the runs' own end-of-run checks cannot say so while
other runs are still going).
"""

from __future__ import annotations

from testbed.chaos.lab import CHUNK_SIZE, Lab
from testbed.chaos.report import ScenarioResult
from testbed.chaos.watch import ServerWatch, wait_quiescent
from testbed.core import protocol as p
from testbed.core.rpc import RpcClient

WORKLOADS = ("chat", "docqa", "rag", "random")
_CAPACITY = "4MiB"


def shared_server(lab: Lab) -> ScenarioResult:
    n = lab.config.shared_requests
    result = lab.result(
        f"four engines ({', '.join(WORKLOADS)}, {n} requests each) on one {_CAPACITY} server at "
        "once: capacity never exceeded under constant eviction, every retrieved byte right, "
        "nothing held once they are done",
    )
    server = lab.server("--chunk-size", str(CHUNK_SIZE), "--capacity", _CAPACITY)
    with ServerWatch(server.url, server.token, server.pid) as watch:
        children = [
            lab.run(lab.spec(workload, n, seed=index), server, workload)
            for index, workload in enumerate(WORKLOADS)
        ]
        for child in children:
            child.wait(600.0)
        watch.sample()
    summaries = [lab.record_run(result, child) for child in children]
    with RpcClient(server.url, role="chaos", token=server.token, timeout_s=2.0) as client:
        held = wait_quiescent(client, 2.0)
        reply = client.call(p.GetStats())
        assert isinstance(reply, p.ServerStats)
    result.set(capacity_violations=watch.capacity_violations)
    result.maximum(max_server_rss_mib=watch.max_rss_mib or None)
    if held is not None:
        result.set(**held.leaks())
    evicted = reply.evicted_objects
    result.checks["the server evicted (capacity pressure)"] = evicted > 0
    result.checks["the watcher sampled"] = watch.samples > 0
    retrieved = sum((summary or {}).get("retrieved_bytes") or 0 for summary in summaries)
    result.checks["bytes were retrieved (and checked)"] = retrieved > 0
    result.details.update(
        samples=watch.samples,
        max_used_bytes=watch.max_used_bytes,
        evicted_objects=evicted,
        held_after=None if held is None else held.record(),
        runs={
            workload: None
            if summary is None
            else {
                key: summary.get(key)
                for key in (
                    "requests",
                    "integrity_errors",
                    "external_hit_tokens",
                    "retrieved_bytes",
                    "max_step_stall_s",
                    "store_failures",
                    "retrieve_failures",
                )
            }
            for workload, summary in zip(WORKLOADS, summaries, strict=True)
        },
    )
    return result
