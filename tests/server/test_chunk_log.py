"""``kvtb server --run-dir``: the server's spans and its chunk event log land in the run
directory; with ``--no-chunk-log`` its spans only (what ``kvtb bench`` compares to price the
log)."""

from __future__ import annotations

import pytest

from testbed.analysis.chunklog import load_chunk_log
from testbed.core.keys import chunk_hashes
from testbed.core.run_dir import RunDir
from tests.support.cache_harness import connect
from tests.support.tier_flows import OBJECT_BYTES, C, Worker, lookup


@pytest.mark.parametrize("chunk_log", [True, False], ids=["chunk-log", "no-chunk-log"])
def test_a_run_directory_gets_the_servers_spans_and_its_chunk_log_unless_told_not_to(
    start_server, tmp_path, chunk_log
):
    run_dir = RunDir(tmp_path / "run")
    flags = ["--chunk-size", str(C), "--capacity", str(4 * OBJECT_BYTES)]
    flags += ["--run-dir", str(run_dir.path), *([] if chunk_log else ["--no-chunk-log"])]
    server = start_server(*flags)
    hashes = chunk_hashes(list(range(3 * C)), C)
    with Worker(server) as worker, connect(server, role="scheduler") as scheduler:
        worker.store("writer", hashes)
        assert lookup(scheduler, "reader", hashes).hit_chunks == 3
    server.close()
    spans = "".join(path.read_text() for path in run_dir.spans.glob("kvtb-server-*.jsonl"))
    assert '"kvcache.server.lookup"' in spans and '"kvcache.server.store' in spans
    streams = list(run_dir.chunk_streams.glob("*.msgpack"))
    if chunk_log:
        log = load_chunk_log(run_dir.path)
        assert sorted(log[log["event"] == "commit"]["chunk_hash"]) == sorted(hashes)
    else:
        assert streams == []
