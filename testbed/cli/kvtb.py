"""``kvtb``: the testbed's command line.

kvtb server ...                 run a cache server (python -m server)
kvtb run [--config F.toml] ...  one run into runs/<run_id>/
kvtb sweep FILE.toml            a grid of runs (resumable), then its index
kvtb report runs/<sweep>        tables and figures for a sweep
kvtb export jaeger DIR... -o F  Jaeger-UI JSON of runs' (or sweeps') spans
kvtb explain RUN REQUEST_ID     why one request of a run hit or missed
kvtb whatif SOURCE --out DIR    hit rate at every capacity, chunk size and policy, one pass
kvtb chaos [--quick] --out DIR  reliability scenarios (kills, restarts, fuzzing) → a report
kvtb bench [--quick] [--peer] --out DIR  every benchmark (and the real LMCache) → a report
kvtb demo                       the main job: a small sweep and its report
kvtb clean                      remove files left by cache servers that were killed

``server`` needs only the base install; the other commands need the ``lab`` extra (and the
replay and vllm engines need vLLM) and say so, before writing anything, when it is missing.

Exit status, every command (README, "Exit codes"): 0 done; 1 failed (the work ran and did not
succeed: a run with integrity errors, a failed sweep run, chaos acceptance not met, an
operating-system error such as a full disk); 2 bad input (a flag, spec, TOML, token file or a
resource request the machine cannot meet, refused before any work, nothing written); 130
interrupted (Ctrl-C or SIGTERM).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from server.launch import ServerStartError
from testbed.core.credentials import ServerEndpoint, client_token
from testbed.core.extras import MissingExtra, require_engines, require_lab, require_redis
from testbed.core.process_groups import sigterm_as_interrupt
from testbed.core.telemetry.setup import add_otlp_arguments
from testbed.core.version import package_version
from testbed.spec.flags import (
    add_data_dir_argument,
    add_set_argument,
    add_spec_arguments,
    asked_keys,
    assignments,
    spec_from_args,
)
from testbed.spec.paths import absolute_path


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command of ``argv``; its exit status. SIGTERM interrupts a command as Ctrl-C
    does (``testbed.core.process_groups.sigterm_as_interrupt``): it unwinds, stopping every
    process it started, and exits 130 (``kvtb server`` handles its own signals)."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "server":
            code: int = args.handler(args)
            return code
        require_lab()
        with sigterm_as_interrupt():
            code = args.handler(args)
        return code
    except MissingExtra as exc:
        print(f"kvtb {args.command} {exc}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError) as exc:
        print(f"kvtb {args.command}: {exc}", file=sys.stderr)
        return 2
    except (OSError, ServerStartError) as exc:
        print(f"kvtb {args.command}: failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"kvtb {args.command}: interrupted", file=sys.stderr)
        return 130


def build_parser() -> argparse.ArgumentParser:
    """``kvtb``'s parser: every command's parser sets ``handler``, the function that runs it
    (``args.handler(args)``: the command's exit status)."""
    parser = argparse.ArgumentParser(
        prog="kvtb", description=__doc__.split("\n")[0].split(": ", 1)[-1]
    )
    parser.add_argument(
        "--version", action="version", version=f"kvtb {package_version() or '(not installed)'}"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    from server.app import build_parser as build_server_parser
    from server.app import run as run_server

    server = commands.add_parser("server", help="run a KV cache server")
    build_server_parser(server)
    server.set_defaults(handler=run_server)

    run = commands.add_parser("run", help="one run (engine + workload) into a run directory")
    _add_run_arguments(run)
    run.set_defaults(handler=_run)
    _add_sweep_parsers(commands)
    _add_export_parser(commands)

    from testbed.bench.command import add_bench_parser, run_bench
    from testbed.chaos.command import add_chaos_parser, run_chaos
    from testbed.cli.explain import add_explain_parser, run_explain
    from testbed.cli.whatif import add_whatif_parser, run_whatif

    for name, add_parser, handler in (
        ("explain", add_explain_parser, run_explain),
        ("whatif", add_whatif_parser, run_whatif),
        ("chaos", add_chaos_parser, run_chaos),
        ("bench", add_bench_parser, run_bench),
    ):
        add_parser(commands)
        commands.choices[name].set_defaults(handler=handler)

    commands.add_parser(
        "clean", help="remove pool and token files of cache servers that no longer run"
    ).set_defaults(handler=_clean)
    demo = commands.add_parser("demo", help="the main job: a small sweep and its report")
    demo.add_argument(
        "--out", type=absolute_path, default="runs", help="parent directory (default: runs)"
    )
    add_set_argument(demo)
    demo.set_defaults(handler=_demo)
    return parser


def _add_sweep_parsers(commands: Any) -> None:
    """``kvtb sweep`` and ``kvtb report``."""
    sweep = commands.add_parser("sweep", help="run a sweep file's grid (skips finished runs)")
    sweep.add_argument(
        "file", type=Path, help="sweep TOML file, or the name of a shipped one (see experiments/)"
    )
    sweep.add_argument(
        "--out",
        type=absolute_path,
        default="runs",
        help="parent of the sweep directory (default: runs)",
    )
    sweep.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="runs in parallel (default: 1 locally, every CPU of a local Ray)",
    )
    sweep.add_argument(
        "--executor",
        choices=["local", "ray"],
        default="local",
        help="where the runs run: local processes or Ray tasks (default: local)",
    )
    sweep.add_argument("--address", help="Ray cluster address (default: start a local Ray)")
    sweep.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_data_dir_argument(sweep)
    add_set_argument(sweep)
    sweep.set_defaults(handler=_sweep)

    report = commands.add_parser("report", help="tables and figures for a sweep directory")
    report.add_argument("sweep_dir", type=absolute_path, help="the sweep's directory (runs/NAME)")
    report.set_defaults(handler=_report)


def _add_export_parser(commands: Any) -> None:
    export = commands.add_parser("export", help="export the spans of runs or sweeps")
    formats = export.add_subparsers(dest="format", required=True, metavar="FORMAT")
    jaeger = formats.add_parser("jaeger", help="Jaeger-UI JSON (upload it in the Jaeger UI)")
    jaeger.add_argument(
        "run_dirs", type=absolute_path, nargs="+", metavar="DIR", help="run or sweep directories"
    )
    jaeger.add_argument(
        "-o", "--output", type=absolute_path, required=True, help="the JSON file to write"
    )
    jaeger.add_argument(
        "--request",
        action="append",
        default=None,
        metavar="ID",
        dest="request_ids",
        help="only the traces of this request id (repeatable)",
    )
    jaeger.set_defaults(handler=_export_jaeger)


def _clean(args: argparse.Namespace) -> int:
    from server.reclaim import reclaim_dead_server_files

    removed = reclaim_dead_server_files()
    for path in removed:
        print(f"removed {path}")
    print(f"{len(removed)} files of stopped cache servers removed")
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from testbed.sweep.cli import run_sweep_command

    return run_sweep_command(args)


def _report(args: argparse.Namespace) -> int:
    from testbed.report.sweep_report import write_report

    path = write_report(args.sweep_dir)
    print(f"report: {path}")
    return 0


def _export_jaeger(args: argparse.Namespace) -> int:
    from testbed.report.jaeger import export_jaeger

    count = export_jaeger(args.run_dirs, args.output, request_ids=args.request_ids)
    print(f"wrote {count} spans to {args.output}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from testbed.cli.demo import demo

    return demo(args.out, assignments(args.set))


# ---------------------------------------------------------------------------------------------
# kvtb run
# ---------------------------------------------------------------------------------------------


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    sections = add_spec_arguments(parser)
    parser.add_argument(
        "--out", type=absolute_path, default="runs", help="parent directory (default: runs)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    cache, engine, tracing = sections["cache"], sections["engine"], sections["tracing"]
    cache.add_argument(
        "--server", help="use this cache server (tcp://HOST:PORT) instead of starting one"
    )
    cache.add_argument(
        "--token-file",
        type=absolute_path,
        help="the --server's token file (its readiness line prints the path; default: "
        "KVTB_TOKEN_FILE or KVTB_TOKEN)",
    )
    engine.add_argument(
        "--endpoint",
        help="serve engine: a running vLLM OpenAI server with the connector (http://HOST:PORT)",
    )
    engine.add_argument(
        "--endpoints",
        help="serve engine: several running vLLM OpenAI servers (URL,URL), routed by --router",
    )
    engine.add_argument(
        "--launch",
        action="store_true",
        help="serve engine: start kvtb server and vLLM's OpenAI server for the run, then stop "
        "them (--instances N: N servers, routed by --router)",
    )
    add_otlp_arguments(tracing)


def _run(args: argparse.Namespace) -> int:
    from testbed.run import RunOptions, execute_run

    spec = spec_from_args(args)
    require_engines([spec.engine])  # before the run directory is made
    require_redis(spec.tiers)
    summary = execute_run(
        spec,
        args.out,
        RunOptions(
            server=_endpoint(args),
            endpoint=args.endpoint,
            endpoints=tuple(filter(None, (args.endpoints or "").split(","))),
            launch=args.launch,
            progress=not args.no_progress,
            otlp_endpoint=args.otlp_endpoint,
            otlp_protocol=args.otlp_protocol,
            asked=asked_keys(args),
        ),
    )
    from testbed.run.summary_text import summary_lines

    print("\n".join(summary_lines(summary, args.out / spec.run_id)))
    return 1 if summary.get("failures") or summary.get("integrity_errors") else 0


def _endpoint(args: argparse.Namespace) -> ServerEndpoint | None:
    """The ``--server`` to use and its credential, checked before any work."""
    if args.server is None:
        if args.token_file is not None:
            raise ValueError("--token-file goes with --server (a run's own server makes its own)")
        return None
    if not args.server.startswith(("tcp://", "ipc://")):
        raise ValueError(
            f"--server {args.server!r} is not a ZeroMQ endpoint; give tcp://HOST:PORT as "
            "`kvtb server` prints it"
        )
    host, _, port = args.server.removeprefix("tcp://").rpartition(":")
    if args.server.startswith("tcp://") and (not host or not port.isdigit()):
        raise ValueError(f"--server {args.server!r}: expected tcp://HOST:PORT")
    token = client_token(None, args.token_file)
    if not token:
        raise ValueError(
            "--server needs the server's credential: --token-file PATH (printed in the server's "
            "readiness line), or KVTB_TOKEN_FILE / KVTB_TOKEN"
        )
    return ServerEndpoint(args.server, token)
