"""``kvtb whatif SOURCE --out DIR``: hit rate at every capacity, chunk size and policy.

``SOURCE`` is a run directory (its recorded external-cache accesses: chunk event log and
request spans) or a workload spec (``chat``, ``mooncake:PATH``; or ``--workload``), whose
requests are built exactly as an oracle run of the same keys would build them (``--requests``,
``--seed``, ``--workload-param``, ``--max-output-tokens``, ``--block-size``, ``--engine-blocks``
or ``--config F.toml``). Writes ``DIR/whatif.json`` and Parquet tables
(:mod:`testbed.analysis.whatif.results`), figures with ``--figures``, and prints a summary.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from testbed.spec.flags import add_data_dir_argument
from testbed.spec.paths import absolute_path

_WORKLOAD_FLAGS = (
    "requests",
    "seed",
    "max_output_tokens",
    "block_size",
    "engine_blocks",
    "chunk_size",
    "profile",
    "tp",
)


def add_whatif_parser(commands: Any) -> None:
    """Adds ``whatif`` to ``kvtb``'s subcommands (``commands``: argparse's subparsers)."""
    parser = commands.add_parser(
        "whatif", help="hit rate at every capacity, chunk size and policy from one pass"
    )
    parser.add_argument(
        "source", nargs="?", metavar="SOURCE", help="a run directory or a workload spec"
    )
    parser.add_argument("--workload", help="a workload spec (instead of SOURCE)")
    parser.add_argument(
        "--config", type=absolute_path, help="TOML file with run keys (flags override)"
    )
    add_data_dir_argument(parser)
    for name in _WORKLOAD_FLAGS:
        parser.add_argument("--" + name.replace("_", "-"), default=None, metavar=name.upper())
    parser.add_argument("--mla", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument(
        "--workload-param", action="append", default=[], metavar="KEY=VALUE",
        help="a workload generator parameter (repeatable; VALUE is parsed as TOML)",
    )  # fmt: skip
    parser.add_argument("--chunk-sizes", help="comma-separated chunk sizes (default: the source's)")
    parser.add_argument(
        "--policies", default="lru,belady", help="lru,belady,fifo,lfu (default: lru,belady)"
    )
    parser.add_argument("--at", help="comma-separated capacities (tokens) for exact points")
    parser.add_argument(
        "--sample-rate", type=float, default=1.0, help="SHARDS-style sampling rate (default: 1)"
    )
    parser.add_argument("--grid-points", type=int, default=48)
    parser.add_argument("--policy-points", type=int, default=8)
    parser.add_argument(
        "--time-profiles", help="comma-separated time models: flat, h100, h200, a100, l40s"
    )
    parser.add_argument("--hardware-file", type=absolute_path, help="TOML hardware profiles to add")
    parser.add_argument(
        "--tiers", action="store_true",
        help="hit tokens per tier (L1 host, L2 disk) at every (L1, L2) capacity pair",
    )  # fmt: skip
    parser.add_argument("--l1", help="--tiers: comma-separated L1 capacities (tokens)")
    parser.add_argument("--l2", help="--tiers: comma-separated L2 capacities (tokens)")
    parser.add_argument(
        "--tier-policies", default="write_through+retain",
        help="--tiers: comma-separated TIER_WRITE+TIER_PROMOTE (write_through+retain is one "
        "pass; write_back, selective:N and promotion none are simulated)",
    )  # fmt: skip
    parser.add_argument(
        "--tier-time", metavar="PROFILE",
        help="--tiers: project each point's mean TTFT under this time model (h100, ...)",
    )  # fmt: skip
    parser.add_argument(
        "--tier-links", default="gen5", metavar="NAME",
        help="--tiers: the links of the projection (gen4, gen5, gen5-400g; default gen5)",
    )  # fmt: skip
    parser.add_argument("--figures", action="store_true", help="also write PNG figures")
    parser.add_argument("--out", type=absolute_path, required=True, help="output directory")


def run_whatif(args: argparse.Namespace) -> int:
    """Computes, writes and summarises the what-if; 0 on success."""
    from testbed.analysis.whatif import WhatIfOptions, what_if_run, what_if_workload, write_whatif
    from testbed.models.hardware import load_hardware

    options = WhatIfOptions(
        chunk_sizes=_ints(args.chunk_sizes, "--chunk-sizes"),
        policies=tuple(_items(args.policies)),
        at_tokens=_ints(args.at, "--at") or (),
        sample_rate=args.sample_rate,
        grid_points=args.grid_points,
        policy_points=args.policy_points,
        time_profiles=tuple(_items(args.time_profiles)),
        hardware=load_hardware(args.hardware_file) if args.hardware_file else None,
        tiers=_tier_grid(args),
    )
    if args.source and args.workload:
        raise ValueError("give SOURCE or --workload, not both")
    source = args.source or args.workload
    if source is None:
        raise ValueError("name a SOURCE: a run directory or a workload spec (or --workload)")
    if Path(source).is_dir():
        whatif = what_if_run(source, options)
    else:
        whatif = what_if_workload(_workload_spec(args, source), options)
    path = write_whatif(whatif, args.out)
    if args.figures:
        _write_figures(whatif, args.out)
    _print_summary(whatif, path)
    return 0


def _tier_grid(args: argparse.Namespace) -> Any:
    if not args.tiers:
        if args.l1 or args.l2:
            raise ValueError("--l1 and --l2 need --tiers")
        return None
    from testbed.analysis.whatif.tiers import TierGrid
    from testbed.models.tier_sim import TierPolicy

    policies = []
    for item in _items(args.tier_policies):
        write, plus, promote = item.partition("+")
        if not plus:
            raise ValueError(
                f"--tier-policies expects TIER_WRITE+TIER_PROMOTE items "
                f"(e.g. write_back+none), got {item!r}"
            )
        policies.append(TierPolicy(write, promote))
    return TierGrid(
        _ints(args.l1, "--l1") or (),
        _ints(args.l2, "--l2") or (),
        tuple(policies),
        time_profile=args.tier_time,
        links=args.tier_links,
    )


def _workload_spec(args: argparse.Namespace, workload: str) -> Any:
    from testbed.spec.flags import spec_from_args

    values = argparse.Namespace(**vars(args))
    values.workload = workload
    return spec_from_args(values)


def _write_figures(whatif: Any, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from testbed.analysis import plots
    from testbed.analysis.whatif.figures import whatif_figures

    source = whatif.meta["source"]
    context = source.get("run_id") or plots.short_label(source.get("workload", ""))
    for name, figure, _ in whatif_figures(whatif, context=context):
        figure.savefig(out / name, dpi=110)
        plots.close(figure)


def _print_summary(whatif: Any, path: Path) -> None:
    meta = whatif.meta
    print(
        f"what-if of {meta['num_requests']} requests, {meta['prompt_tokens']:,} prompt tokens "
        f"→ {path}"
    )
    run_source = (meta.get("source") or {}).get("kind") == "run"
    for size in meta["chunk_sizes"]:
        unlimited = whatif.point(size, None)
        gauge = whatif.min_capacity[whatif.min_capacity["chunk_size"] == size]
        at_90 = gauge[gauge["fraction"] == 0.9]["capacity_tokens"]
        external = unlimited["external_hit_tokens"] / max(meta["prompt_tokens"], 1)
        if run_source:  # the run's hits count vLLM's own; the gauge counts the external ones
            line = (
                f"  chunk {size}, unlimited cache: token hit rate {unlimited['token_hit_rate']:.2%}"
                f" (vLLM's prefix cache + external), external {external:.2%}"
            )
            what = "the external hits"
        else:
            line = f"  chunk {size}, unlimited cache: external hit rate {external:.2%}"
            what = "them"
        if len(at_90):
            line += f"; 90% of {what} from {int(at_90.iloc[0]):,} tokens of LRU capacity"
        print(line)
    run = meta.get("run")
    if run:
        print(
            f"  run at {run['capacity_tokens']} tokens: predicted external hits "
            f"{run['predicted_external_hit_tokens']:,}, measured "
            f"{run['measured_external_hit_tokens']:,} "
            f"(residual {run['residual_fraction_of_prompt_tokens']:+.3%} of prompt tokens)"
        )
    if whatif.tiers is not None:
        _print_tiers(whatif.tiers)
    sampling = meta.get("sampling")
    if sampling:
        errors = ", ".join(f"{k}: {v:.4f}" for k, v in sampling["estimated_max_error"].items())
        print(f"  sampled at {meta['sample_rate']}: estimated max error {errors}")
    time = meta.get("time")
    if time:
        for row in time["break_even"]:
            print(
                f"  {row['time_profile']}, chunk {row['chunk_size']}: a hit pays from "
                f"{row['break_even_prompt_tokens']} prompt tokens"
            )


def _print_tiers(tiers: Any) -> None:
    """One line per (chunk size, policy, L1): the largest L2 of the grid (tiers.parquet has all)."""
    columns = ["chunk_size", "tier_write", "tier_promote", "l1_capacity_tokens"]
    order = [*columns, "l2_capacity_tokens"]
    largest = tiers.sort_values(order).groupby(columns, sort=False).tail(1)
    for row in largest.to_dict("records"):
        print(
            f"  tiers ({row['method'].replace('_', ' ')}, {row['tier_write']}+"
            f"{row['tier_promote']}), chunk {row['chunk_size']}, L1 "
            f"{row['l1_capacity_tokens']:,} / L2 {row['l2_capacity_tokens']:,} tokens: "
            f"host {row['host_hit_rate']:.2%}, disk {row['disk_hit_rate']:.2%}, "
            f"total {row['token_hit_rate']:.2%}"
            + (
                f"; projected TTFT {row['ttft_mean_ms']:.1f} ms "
                f"(no cache {row['ttft_no_cache_mean_ms']:.1f} ms, {row['time_profile']}, "
                f"links {row['tier_profile']})"
                if row.get("ttft_mean_ms") is not None
                else ""
            )
        )


def _items(text: str | None) -> list[str]:
    return [item.strip() for item in (text or "").split(",") if item.strip()]


def _ints(text: str | None, flag: str) -> tuple[int, ...] | None:
    items = _items(text)
    if not items:
        return None
    try:
        return tuple(int(float(item)) if "e" in item.lower() else int(item) for item in items)
    except ValueError:
        raise ValueError(f"{flag} expects comma-separated integers, got {text!r}") from None
