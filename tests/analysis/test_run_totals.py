"""Per-run truth from spans: runs sharing one cache server each count their own bytes,
evictions and errors."""

from __future__ import annotations

import pandas as pd

from testbed.analysis import metrics
from testbed.analysis.spans import load_events, load_spans
from testbed.core.telemetry import attributes as a
from tests.analysis.synthetic import OBJECT_BYTES, Prompt, SyntheticRun

C = 4
ABC = Prompt(("a", "b", "c"), tail=2)


def test_two_runs_sharing_a_server_each_report_their_own_figures(tmp_path):
    first = SyntheticRun(tmp_path / "A", chunk_size=C, tp=2, run_id="A")
    second = SyntheticRun(tmp_path / "B", chunk_size=C, tp=2, run_id="B", shared_server=first)
    first.request("a1", ABC)  # stores 3 chunks × 2 KV ranks
    first.request("a2", Prompt(("d",)), store="abort")  # its commit fails: nothing stored
    second.request("b1", ABC)  # all three chunks hit
    second.request("b2", Prompt(("x", "y")), evict=ABC.hashes[2:])  # evicts 2 objects for room
    second.request("b3", ABC, retrieve={1: 4})  # loads chunks 0-1 (rank 1 fails), stores 2
    first.error_reply("a1")
    second.error_reply("b1", "quota: refused: over this client's quota of 1 live sessions")
    second.connector_failure("b2")  # a timeout, not an error reply
    second.abandoned("b2")  # a late lookup's locks released, a store aborted
    second.close()
    first.close()
    spans = pd.concat([load_spans(tmp_path / "A"), load_spans(tmp_path / "B")], ignore_index=True)
    events = pd.concat(
        [load_events(tmp_path / "A"), load_events(tmp_path / "B")], ignore_index=True
    )
    totals = {run: metrics.run_totals(spans, events, run) for run in ("A", "B")}
    assert totals["A"] == {
        "stored_bytes": 3 * 2 * OBJECT_BYTES,
        "retrieved_bytes": 0,
        "evicted_objects": 0,
        "evicted_bytes": 0,
        "server_errors": 1,
        "error_replies": 1,
        "limit_refusals": 0,  # a1's error was not a refusal for a limit
        "store_failures": 2,  # a2's item on each TP rank
        "retrieve_failures": 0,
        "abandoned_releases": 0,
    }
    assert totals["B"] == {
        "stored_bytes": (2 + 1) * 2 * OBJECT_BYTES,  # b2's two chunks, b3's chunk 2
        "retrieved_bytes": (3 * 2 + 2) * OBJECT_BYTES,  # b1: 3 chunks per rank; b3: rank 0
        "evicted_objects": 2,
        "evicted_bytes": 2 * OBJECT_BYTES,
        "server_errors": 1,
        "error_replies": 1,
        "limit_refusals": 1,  # b1's was: a refusal for its client's quota
        "store_failures": 0,
        "retrieve_failures": 1,
        "abandoned_releases": 2,
    }
    # The server-wide figures are the sums of both runs'.
    everything = metrics.run_totals(spans, events)
    summed = (
        "stored_bytes",
        "evicted_bytes",
        "server_errors",
        "error_replies",
        "abandoned_releases",
        "limit_refusals",
    )
    for key in summed:
        assert everything[key] == totals["A"][key] + totals["B"][key], key
    evicted = spans[spans["name"] == a.SERVER_EVICT]
    assert int(evicted[a.EVICTED_BYTES].sum()) == 2 * OBJECT_BYTES


def test_without_server_spans_the_server_side_figures_are_unknown(tmp_path):
    run = SyntheticRun(tmp_path / "run", chunk_size=C, server=False)
    run.request("r1", ABC)
    run.close()
    totals = metrics.run_totals(load_spans(tmp_path / "run"), load_events(tmp_path / "run"))
    assert totals["stored_bytes"] == 3 * OBJECT_BYTES
    assert totals["evicted_bytes"] is None and totals["server_errors"] is None
