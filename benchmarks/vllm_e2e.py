"""End to end inside vLLM on CPU: a prompt's first pass (a miss) and second pass (a hit from the
cache server), against recomputing it with no cache, in both transfer modes.

Three configurations, each its own process holding one vLLM engine (the tiny seeded model,
vLLM's prefix cache off so that every hit comes from the cache server, chunk 256, vLLM's
defaults otherwise: asynchronous loads and stores, lookups and loads polled by vLLM's steps):

- ``no cache``: vLLM alone, no connector: the recompute baseline;
- ``worker``: the connector, the worker copying between vLLM's KV and the server's pool;
- ``server``: the connector, the cache server copying from vLLM's KV in shared memory.

The cache configurations each have their own cache server. Samples interleave the
configurations (each sample: a new random prompt per length, every configuration in turn, in
a shuffled order), so machine noise falls on all alike. A pass is one request with one output
token, timed from ``add_request`` to its output: the time to first token, including the
lookup, the load or the computation, and the start of the store. Between the passes the
engine is stepped until vLLM has released the first pass's blocks (its store committed), so
the second pass measures a hit, not the store race. Prints, per prompt length and
configuration, the median and p90 of each pass, and each median over the no-cache median of
the same pass (the same prompt recomputed: < 1 means faster than recomputing).

    python -m benchmarks.vllm_e2e [--samples 15] [--lengths 1024 4096 16384]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO

import numpy as np

from benchmarks.common import table

CHUNK = 256
BLOCK = 64
CONFIGS = ("no cache", "worker", "server")
RESULT = "KVTB-E2E "
"""Prefix of the child's answer lines (vLLM logs to the same streams)."""


# ---------------------------------------------------------------------------------------------
# Child: one engine, answering "<length> <seed>" lines with the two passes' times
# ---------------------------------------------------------------------------------------------


def child(config: str, url: str, token: str, max_len: int) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from testbed.credentials import ServerEndpoint
    from testbed.engine.model_dir import TinyModel
    from testbed.engine.vllm_engine import VllmEngine, VllmEngineSpec
    from testbed.workloads import WorkloadRequest

    spec = VllmEngineSpec(
        chunk_size=CHUNK,
        block_size=BLOCK,
        engine_blocks=max_len // BLOCK + 16,
        max_num_seqs=4,
        max_num_batched_tokens=max_len,
        max_model_len=max_len + BLOCK,
        prefix_caching=False,
        deterministic=False,  # vLLM's own cadence: lookups and loads polled by steps
        transfer_mode="server" if config == "server" else "worker",
        run_id=f"e2e-{config.replace(' ', '-')}",
    )
    endpoint = None if config == "no cache" else ServerEndpoint(url, token)
    vocab = TinyModel().vocab_size
    with (
        tempfile.TemporaryDirectory(prefix="kvtb-e2e-") as work,
        VllmEngine(spec, endpoint, work_dir=Path(work)) as engine,
    ):

        def one(request_id: str, prompt: np.ndarray) -> float:
            result = engine.run([WorkloadRequest(request_id, prompt, 1, 0.0)])
            engine.drain()
            return result.wall_s

        warm = np.random.default_rng(10**6).integers(3, vocab, 4 * CHUNK).astype(np.int32)
        one("warm-a", warm), one("warm-b", warm)  # first-use costs out of the samples
        _answer({"ready": True})
        for line in sys.stdin:
            length, seed = (int(x) for x in line.split())
            prompt = np.random.default_rng(seed).integers(3, vocab, length).astype(np.int32)
            first = one(f"{seed}-first", prompt)
            second = one(f"{seed}-second", prompt)
            _answer({"first": first, "second": second})


def _answer(message: dict[str, object]) -> None:
    print(RESULT + json.dumps(message), flush=True)


def _read_answer(stream: IO[str]) -> dict[str, float]:
    for line in stream:
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT) :])
    raise RuntimeError("a benchmark engine exited early (its log is above)")


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=15)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--url", default="", help=argparse.SUPPRESS)
    parser.add_argument("--token", default="", help=argparse.SUPPRESS)
    parser.add_argument("--max-len", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.url, args.token, args.max_len)
        return 0
    if args.samples < 1 or min(args.lengths) <= CHUNK:
        parser.error(f"--samples must be positive and every length above {CHUNK}")

    from testbed import protocol as p
    from testbed.engine.vllm_engine import tiny_bytes_per_token
    from testbed.launch import ServerProcess
    from testbed.rpc import RpcClient

    max_len = -(-max(args.lengths) // BLOCK) * BLOCK
    capacity = 2 * sum(args.lengths) * tiny_bytes_per_token() * (args.samples + 2)  # no eviction
    servers = {
        config: ServerProcess(
            ["--chunk-size", str(CHUNK), "--capacity", str(capacity), "--prefault", "0"]
        ).start()
        for config in CONFIGS[1:]
    }
    engines: dict[str, subprocess.Popen[str]] = {}
    try:
        for config in CONFIGS:
            server = servers.get(config)
            engines[config] = subprocess.Popen(
                [sys.executable, "-m", "benchmarks.vllm_e2e", "--child", config,
                 "--url", server.url if server else "", "--token", server.token if server else "",
                 "--max-len", str(max_len)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )  # fmt: skip
        for config, engine in engines.items():
            assert engine.stdout is not None
            _read_answer(engine.stdout)
            print(f"engine ready: {config}", flush=True)
        samples: dict[tuple[int, str], list[dict[str, float]]] = {}
        order = random.Random(0)
        for sample in range(args.samples):
            for length in args.lengths:
                configs = list(CONFIGS)
                order.shuffle(configs)
                for config in configs:
                    engine = engines[config]
                    assert engine.stdin is not None and engine.stdout is not None
                    engine.stdin.write(f"{length} {sample * 1000 + length}\n")
                    engine.stdin.flush()
                    samples.setdefault((length, config), []).append(_read_answer(engine.stdout))
            print(f"sample {sample + 1}/{args.samples}", file=sys.stderr, flush=True)
        print(report(samples, args.lengths, args.samples))
        # Every complete chunk is loaded (the last prompt token is recomputed, not skipped).
        hit_tokens = args.samples * sum(n // CHUNK * CHUNK for n in args.lengths)
        hit_tokens += 4 * CHUNK  # the warm-up's
        for config, server in servers.items():
            with RpcClient(server.url, token=server.token) as client:
                stats = client.call(p.GetStats())
            assert isinstance(stats, p.ServerStats)
            expected = hit_tokens * tiny_bytes_per_token() / 2**20
            print(
                f"{config}: the cache server sent {stats.retrieved_bytes / 2**20:.1f} MiB; every "
                f"second pass hitting would be {expected:.1f} MiB"
            )
        return 0
    finally:
        for engine in engines.values():
            if engine.stdin is not None:
                engine.stdin.close()
        for engine in engines.values():
            try:
                engine.wait(timeout=60)
            except subprocess.TimeoutExpired:
                engine.kill()
        for server in servers.values():
            server.close()


def report(
    samples: dict[tuple[int, str], list[dict[str, float]]], lengths: list[int], n: int
) -> str:
    rows = []
    for length in lengths:
        recompute = samples[(length, "no cache")]
        first_base = statistics.median(s["first"] for s in recompute)
        second_base = statistics.median(s["second"] for s in recompute)
        for config in CONFIGS:
            got = samples[(length, config)]
            first = [s["first"] for s in got]
            second = [s["second"] for s in got]
            rows.append(
                (
                    f"{length}",
                    config,
                    f"{statistics.median(first) * 1e3:.1f}",
                    f"{_p90(first) * 1e3:.1f}",
                    f"{statistics.median(second) * 1e3:.1f}",
                    f"{_p90(second) * 1e3:.1f}",
                    f"{statistics.median(first) / first_base:.2f}",
                    f"{statistics.median(second) / second_base:.3f}",
                )
            )
    header = (
        "tokens",
        "config",
        "1st p50 ms",
        "1st p90 ms",
        "2nd p50 ms",
        "2nd p90 ms",
        "1st / recompute",
        "2nd / recompute",
    )
    return (
        f"time to first token, {n} interleaved samples per cell; / recompute: over the no-cache "
        "median of the same pass (the same prompt, recomputed)\n" + table(rows, header)
    )


def _p90(values: list[float]) -> float:
    return float(np.quantile(values, 0.9))


if __name__ == "__main__":
    sys.exit(main())
