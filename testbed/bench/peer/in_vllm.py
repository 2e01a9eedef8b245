"""LMCache inside vLLM, beside ours: its engines for the vLLM section, and the comparisons.

Each LMCache transfer mode gets its own LMCache server (as each of our configurations gets
its own cache server: a prompt's first pass must miss) and its own vLLM engine with the same
tiny seeded model, sizes and prompts as ours (:mod:`testbed.bench.peer.lmcache_child`).
The figures pair our worker-copies engine with LMCache's ``engine_driven`` one and our
server-copies engine with its ``lmcache_driven`` one; a sample's prompts of every length
are summed, so the ratio weighs long prompts as their time does.
"""

from __future__ import annotations

from pathlib import Path

from testbed.bench.config import BenchConfig
from testbed.bench.figures import Figure
from testbed.bench.peer import lmcache_launch as lmcache
from testbed.bench.peer.engine_protocol import BLOCK, CHUNK
from testbed.bench.peer.env import PeerEnv, default_root
from testbed.bench.processes import BenchProcesses
from testbed.bench.stats import Ratio
from testbed.bench.vllm_e2e import PEER_PAIRS, Answers, EngineChild, series

MEASURES = {
    "lookup_vs_lmcache": (
        "second",
        "lookup_s",
        "a hit's lookup (first get_num_new_matched_tokens "
        "call to the answer, as vLLM's scheduler waits for it)",
    ),
    "store_vs_lmcache": (
        "first",
        "done_s",
        "a miss's whole first pass until its store is done and vLLM freed its blocks",
    ),
    "retrieve_vs_lmcache": (
        "second",
        "ttft_s",
        "a hit's time to first token (lookup, load and the last token's compute)",
    ),
}


def start_peer_engines(
    config: BenchConfig, processes: BenchProcesses, max_len: int, work: Path
) -> list[EngineChild]:
    from testbed.engine.model_dir import TinyModel, write_model_dir
    from testbed.engine.vllm_engine import tiny_bytes_per_token

    env = PeerEnv(config.peer_env or default_root())
    if not env.is_ready():
        raise RuntimeError(f"the peer environment at {env.root} is not ready")
    tiny = TinyModel(max_position_embeddings=max_len + BLOCK)
    model_dir = write_model_dir(work / "peer-model", tiny, weights_seed=0)
    engines = []
    for name, mode in lmcache.MODES.items():
        run_dir = work / name.replace(" ", "-")
        port = lmcache.start_server(
            processes, env, run_dir / "lmcache-server.log", chunk_size=CHUNK, l1_gib=2.0
        )
        log_path = run_dir / "engine.log"
        process = lmcache.start_engine(
            processes,
            env,
            log_path,
            model_dir=model_dir,
            max_len=max_len,
            port=port,
            mode=mode,
            kv_bytes_per_token=tiny_bytes_per_token(),
            vocab=tiny.vocab_size,
        )
        engines.append(EngineChild(name, process, log_path))
    return engines


def peer_figures(answers: Answers, lengths: tuple[int, ...]) -> list[Figure]:
    figures = []
    for key, (pass_, field, what) in MEASURES.items():
        values: dict[str, float | None] = {}
        details = {}
        for ours, theirs in PEER_PAIRS.items():
            if (lengths[0], ours) not in answers:
                continue
            ratio = Ratio.of(
                _summed(answers, lengths, ours, pass_, field),
                _summed(answers, lengths, theirs, pass_, field),
            )
            label = "in_vllm" if ours == "worker" else "in_vllm_server_copies"
            values[label] = ratio.value
            details[label] = {
                "ours_s": ratio.numerator.to_dict(),
                "lmcache_s": ratio.denominator.to_dict(),
                "paired": ratio.paired.to_dict(4),
            }
        figures.append(
            Figure(
                key,
                values,
                f"ours over LMCache's time for {what}, the same prompts "
                f"({', '.join(map(str, lengths))} tokens, summed per sample) in the same vLLM-CPU",
                details=details,
            )
        )
    figures += equality_figures(answers, lengths)
    return figures


def equality_figures(answers: Answers, lengths: tuple[int, ...]) -> list[Figure]:
    hits_equal, outputs_equal, checked = True, True, 0
    for length in lengths:
        engines = [e for (n, e) in answers if n == length]
        for index in range(len(answers[(length, engines[0])])):
            for ours, theirs in PEER_PAIRS.items():
                if (length, ours) in answers and (length, theirs) in answers:
                    mine = answers[(length, ours)][index]["second"]["hit_tokens"]
                    other = answers[(length, theirs)][index]["second"]["hit_tokens"]
                    hits_equal &= mine == other
            for pass_ in ("first", "second"):
                outputs = {tuple(answers[(length, e)][index][pass_]["output"]) for e in engines}
                outputs_equal &= len(outputs) == 1
                checked += 1
    return [
        Figure(
            "hit_tokens_equal_to_lmcache",
            hits_equal,
            "on every hit pass, the tokens our connector loaded (its answer to "
            "get_num_new_matched_tokens) equal LMCache's in the same transfer mode",
        ),
        Figure(
            "outputs_identical",
            outputs_equal,
            f"greedy output tokens of all {checked} passes identical across vLLM without a "
            "connector (its prefix cache off, and on), ours (both modes) and LMCache (both "
            "modes)",
        ),
    ]


def _summed(
    answers: Answers, lengths: tuple[int, ...], engine: str, pass_: str, field: str
) -> list[float]:
    per_length = [series(answers, n, engine, pass_, field) for n in lengths]
    return [sum(values) for values in zip(*per_length, strict=True)]
