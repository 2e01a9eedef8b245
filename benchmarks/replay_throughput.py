"""Replay throughput on the Mooncake conversation trace, against vLLM's scheduler alone.

Both runs use the same requests, virtual clock and scheduler settings, in this process: the
baseline is vLLM's v1 scheduler with no connector and no KV (what any scheduler-level
simulation pays), the replay adds our connector, a cache server process over ZeroMQ, real KV
tensors with deterministic content, stores, retrieves and the check of every loaded block.
Prints requests/s and prompt tokens/s of each, and their ratio.

    python -m benchmarks.replay_throughput [--requests N] [--capacity 4GiB] [--chunk-size 512]

The full trace (12,031 requests, 145M prompt tokens) takes several minutes; the cache is
capped (LRU) so that the server's pool stays in memory.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.common import table
from testbed.credentials import ServerEndpoint
from testbed.engine.profiles import get_profile
from testbed.engine.replay import ReplayEngine, ReplaySpec
from testbed.launch import ServerProcess
from testbed.run import max_model_len
from testbed.sizes import parse_bytes
from testbed.workloads import make_workload

TRACE = (
    Path(__file__).resolve().parents[2]
    / "shared"
    / "data"
    / "mooncake"
    / "conversation_trace.jsonl"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--requests", type=int, default=None, help="first N requests (default: all)"
    )
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument("--capacity", default="4GiB")
    parser.add_argument("--trace", type=Path, default=TRACE)
    args = parser.parse_args()
    requests = list(
        make_workload(f"mooncake:{args.trace}", num_requests=args.requests, max_output_tokens=16)
    )
    tokens = sum(len(r.prompt_token_ids) for r in requests)
    spec = ReplaySpec(
        profile=get_profile("tiny"),
        chunk_size=args.chunk_size,
        engine_blocks=8192,
        max_model_len=max_model_len(requests, 64),
        run_id="bench",
    )
    results = {}
    with ReplayEngine(spec, None) as baseline:
        results["vLLM scheduler, no connector"] = baseline.run(requests)
    server_args = [
        "--chunk-size",
        str(args.chunk_size),
        "--capacity",
        str(parse_bytes(args.capacity)),
    ]
    with (
        ServerProcess(server_args) as server,
        ReplayEngine(spec, ServerEndpoint(server.url, server.token)) as replay,
    ):
        results["replay (connector + server + KV)"] = replay.run(requests)
    rows = []
    base_s = results["vLLM scheduler, no connector"].wall_s
    for name, result in results.items():
        rows.append(
            (
                name,
                f"{result.wall_s:.1f}",
                f"{len(result.records) / result.wall_s:,.1f}",
                f"{tokens / result.wall_s / 1e6:.2f}",
                f"{result.wall_s / base_s:.2f}x",
                str(result.integrity_errors),
            )
        )
    print(f"{len(requests)} requests, {tokens / 1e6:.1f}M prompt tokens, chunk {args.chunk_size}")
    print(
        table(
            rows,
            ("engine", "wall s", "requests/s", "Mtok/s", "time vs baseline", "integrity errors"),
        )
    )


if __name__ == "__main__":
    main()
