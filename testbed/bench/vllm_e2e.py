"""Inside vLLM on CPU: a prompt's first pass (a miss, stored) and second pass (a hit), against
recomputing it with no cache, in both transfer modes; and the RPC round trip inside vLLM.

Each configuration is its own process holding one vLLM engine (the tiny seeded model, vLLM's
prefix cache off so that every hit comes from the cache server, chunk 256, blocks of 64,
vLLM's defaults otherwise: asynchronous loads and stores, lookups and loads polled by vLLM's
steps): ``no cache`` (vLLM alone, no connector: the recompute baseline), ``worker`` (our
connector, the worker copying), ``mirror`` (the same with the lookup mirror: a miss answered
without a round trip) and ``server`` (our connector, the cache server copying from
vLLM's KV in shared memory), each cache configuration with its own server, tracing on as
``kvtb run`` does; and ``vllm prefix cache`` (vLLM alone with its prefix cache on: its second
pass is a hit in vLLM's own blocks, the floor under any hit's time to first token). Samples
interleave the configurations (each sample: a new random prompt per length, every
configuration in turn). A pass is one request of 4 output tokens; its time
is the time to first token (``add_request`` to the first token): lookup, load or compute, and
the start of the store. Between the passes the engine is stepped until vLLM has released the
first pass's blocks (its store committed), so the second pass measures a hit.

The RPC round trip is read from the worker configuration's own spans: a store's
``kvcache.server_ms`` (request sent → reply arrived, both of its round trips) halved, beside
the server's own handling of the same stores (its ``kvcache.server.store`` spans).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from testbed.bench.peer.engine_protocol import (
    BLOCK,
    CHUNK,
    OUTPUT_TOKENS,
    LookupTimer,
    answer,
    prompt,
    read_answer,
)
from testbed.bench.processes import BenchProcesses

Answers = dict[tuple[int, str], list[dict[str, Any]]]
"""(prompt length, engine) → one answer per sample: ``first`` and ``second`` passes."""
PEER_PAIRS = {"worker": "LMCache engine_driven", "server": "LMCache lmcache_driven"}
"""Our transfer modes and LMCache's equivalents (the worker copies; the server copies)."""


def series(answers: Answers, length: int, engine: str, pass_: str, field: str) -> list[float]:
    return [float(a[pass_][field]) for a in answers[(length, engine)]]


if TYPE_CHECKING:
    from server.launch import ServerProcess
    from testbed.engine.vllm_engine import VllmEngine, VllmEngineSpec

CHILD_CONFIGS = ("no cache", "worker", "mirror", "server", "vllm prefix cache")
MIRROR = "mirror"
"""Our connector (worker copies) with the lookup mirror (``kvtb.lookup_mirror``): a miss is
answered in the call that asks, without a round trip or a step's wait."""
NATIVE = "vllm prefix cache"
"""vLLM alone with its own prefix cache on: its second pass is a hit held in vLLM's blocks,
the least any hit can cost (no lookup, no load), beside which a cache server's hits are read."""
WITHOUT_CONNECTOR = ("no cache", NATIVE)
"""The configurations that run vLLM alone (no connector, no cache server)."""


def child(config: str, url: str, token: str, max_len: int, run_dir: str) -> None:
    """One engine answering ``<length> <seed>`` lines with both passes' TTFT and outputs."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from testbed.core.credentials import ServerEndpoint
    from testbed.core.telemetry.setup import TracingConfig, configure_tracing
    from testbed.engine.model_dir import TinyModel
    from testbed.engine.vllm_engine import VllmEngine

    endpoint = None if config in WITHOUT_CONNECTOR else ServerEndpoint(url, token)
    tracing = configure_tracing(TracingConfig("kvtb-engine", run_dir=Path(run_dir)))
    vocab = TinyModel().vocab_size
    timer = LookupTimer()
    if endpoint is not None:
        import importlib

        from testbed.engine.vllm_setup import CONNECTOR_CLASS, CONNECTOR_MODULE

        timer.install(getattr(importlib.import_module(CONNECTOR_MODULE), CONNECTOR_CLASS))
    try:
        with VllmEngine(_engine_spec(config, max_len), endpoint, work_dir=Path(run_dir)) as engine:
            warm = prompt(10**6, 4 * CHUNK, vocab)
            for request_id in ("warm-a", "warm-b"):  # first-use costs out of the samples
                _timed_pass(engine, timer, request_id, warm)
            answer({"ready": True})
            for line in sys.stdin:
                length, seed = (int(x) for x in line.split())
                tokens = prompt(seed, length, vocab)
                first = _timed_pass(engine, timer, f"{seed}-first", tokens)
                second = _timed_pass(engine, timer, f"{seed}-second", tokens)
                answer({"first": first, "second": second})
    finally:
        if tracing is not None:
            tracing.shutdown()


def _engine_spec(config: str, max_len: int) -> VllmEngineSpec:
    """The engine of configuration ``config`` (one of :data:`CHILD_CONFIGS`) for prompts of up
    to ``max_len`` tokens."""
    from testbed.engine.vllm_engine import VllmEngineSpec

    return VllmEngineSpec.of(
        chunk_size=CHUNK,
        block_size=BLOCK,
        engine_blocks=max_len // BLOCK + 16,
        max_num_seqs=4,
        max_num_batched_tokens=max_len,
        max_model_len=max_len + BLOCK,
        prefix_caching=config == NATIVE,
        deterministic=False,  # vLLM's own cadence: lookups and loads polled by steps
        transfer_mode="server" if config == "server" else "worker",
        lookup_mirror=config == MIRROR,
        engine_id=f"e2e-{config.replace(' ', '-')}",
    )


def _timed_pass(
    engine: VllmEngine, timer: LookupTimer, request_id: str, tokens: list[int]
) -> dict[str, Any]:
    """One request of ``tokens`` run to its end and drained: its time to first token, its
    wall time to done, its lookup's (:meth:`LookupTimer.take`) and its output tokens."""
    from testbed.workloads import WorkloadRequest

    request = WorkloadRequest(request_id, np.array(tokens, dtype=np.int32), OUTPUT_TOKENS, 0.0)
    started = time.perf_counter()
    result = engine.run([request])
    engine.drain()
    done_s = time.perf_counter() - started
    record = result.records[0]
    return {
        "ttft_s": record.first_token_s,
        "done_s": done_s,
        **timer.take(),
        "output": result.output_token_ids[request_id],
    }


class EngineChild:
    """A process speaking the ``<length> <seed>`` protocol (ours or the peer's)."""

    def __init__(self, name: str, process: subprocess.Popen[str], log_path: Path) -> None:
        self.name = name
        self.process = process
        self.log_path = log_path

    def ready(self) -> None:
        self.ask_line("")

    def ask(self, length: int, seed: int) -> dict[str, Any]:
        return self.ask_line(f"{length} {seed}")

    def ask_line(self, line: str) -> dict[str, Any]:
        """Sends ``line`` (none when empty) and returns the answer; ``RuntimeError`` with the
        end of the engine's log if it exits instead."""
        assert self.process.stdin is not None and self.process.stdout is not None
        try:
            if line:
                self.process.stdin.write(line + "\n")
                self.process.stdin.flush()
            return read_answer(self.process.stdout)
        except (RuntimeError, BrokenPipeError) as exc:
            tail = self.log_path.read_text(errors="replace").strip().splitlines()[-3:]
            raise RuntimeError(
                f"the {self.name} engine exited ({self.log_path}): {' / '.join(tail)}"
            ) from exc

    def finish(self, timeout_s: float = 30.0) -> None:
        """Ends the engine's input; it shuts vLLM down and exits."""
        if self.process.stdin is not None and not self.process.stdin.closed:
            self.process.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=timeout_s)


def start_our_engine(
    processes: BenchProcesses,
    config: str,
    server: ServerProcess | None,
    max_len: int,
    run_dir: Path,
) -> EngineChild:
    """One of our engines (``no cache``, ``worker`` or ``server``) in a process of its own."""
    command = [
        sys.executable,
        "-m",
        "testbed.bench.vllm_e2e",
        "--child",
        config,
        "--url",
        server.url if server else "",
        "--token",
        server.token if server else "",
        "--max-len",
        str(max_len),
        "--run-dir",
        str(run_dir),
    ]
    log_path = run_dir / "engine.log"
    process = processes.start(command, log_path, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    return EngineChild(config, process, log_path)


def main(argv: list[str] | None = None) -> int:
    """The child's entry point (``python -m testbed.bench.vllm_e2e --child CONFIG ...``)."""
    import argparse

    parser = argparse.ArgumentParser(description="kvtb bench: one vLLM engine (internal)")
    parser.add_argument("--child", choices=CHILD_CONFIGS, required=True)
    parser.add_argument("--url", default="")
    parser.add_argument("--token", default="")
    parser.add_argument("--max-len", type=int, required=True)
    parser.add_argument("--run-dir", required=True)
    args = parser.parse_args(argv)
    child(args.child, args.url, args.token, args.max_len, args.run_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
