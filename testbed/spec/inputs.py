"""A spec's inputs on this machine, fixed when the spec is parsed: paths, trace content, sampling.

:func:`resolve_values` turns the run keys a user wrote (flags, a ``--config`` TOML file, a
sweep file) into values that mean the same from any working directory and in any process:

- **Paths.** The path of a ``KIND:PATH`` workload (``mooncake:``, and every other trace kind:
  a file or a directory) is made absolute: relative to the working directory for flags, to
  the file's directory for a TOML file. ``$KVTB_DATA_DIR`` at its start names the data
  directory (:func:`data_dir`): where the public traces are, so that shipped sweeps find them
  from anywhere. A ``model`` that is a local directory is made absolute too. A trace that is
  not there fails here, before any run starts, naming the path and where it came from.
- **Content.** A trace's content hash becomes ``workload_digest``: the run's identity follows
  the trace's content, not its path (moving the checkout keeps run ids, editing the trace
  changes them; ``spec.json`` records the path it was read from). A file hashes its bytes; a
  directory its files (hidden ones left out) in sorted order, each with its relative name.
- **Sampling.** ``OTEL_TRACES_SAMPLER`` / ``_ARG`` become the keys ``trace_sampler`` and
  ``trace_sampler_ratio`` unless the values set them (:mod:`testbed.core.telemetry.sampling`).

Nothing here writes; a digest is read once per file version (cached by size and mtime).
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testbed.core.telemetry.sampling import from_environment
from testbed.spec.paths import absolute as _absolute

DATA_DIR_ENV = "KVTB_DATA_DIR"
"""Environment variable: the data directory (the public traces), as ``--data-dir`` sets it."""
DATA_DIR_VARIABLE = "$" + DATA_DIR_ENV
"""How a path in a spec names the data directory: ``mooncake:$KVTB_DATA_DIR/mooncake/...``."""
CHECKOUT_DATA_DIR = Path("..") / "shared" / "data"
"""The default data directory, relative to the repository root, when running from a checkout."""
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]
_READ_BYTES = 1 << 20


@dataclass(frozen=True)
class DataDir:
    """Where the data directory is, and which setting said so."""

    path: Path | None
    origin: str
    """``--data-dir``, ``KVTB_DATA_DIR``, ``the checkout`` or ``""`` (not set)."""

    def describe(self) -> str:
        return f"{self.path} (from {self.origin})" if self.path is not None else "not set"


def data_dir(flag: Path | str | None = None, env: Mapping[str, str] | None = None) -> DataDir:
    """The data directory: ``--data-dir``, else ``KVTB_DATA_DIR``, else ``../shared/data``
    beside the repository when this package runs from a checkout; else not set."""
    env = os.environ if env is None else env
    if flag is not None:
        return DataDir(_absolute(Path(flag), Path.cwd()), "--data-dir")
    if env.get(DATA_DIR_ENV):
        return DataDir(_absolute(Path(env[DATA_DIR_ENV]), Path.cwd()), DATA_DIR_ENV)
    if (_PACKAGE_ROOT / "pyproject.toml").is_file():
        return DataDir(_absolute(CHECKOUT_DATA_DIR, _PACKAGE_ROOT), "the checkout")
    return DataDir(None, "")


@dataclass(frozen=True)
class InputContext:
    """Where the values being resolved were written."""

    base_dir: Path
    """Relative paths are relative to this: the working directory, or a TOML file's directory."""
    source: str = "command line"
    """Names the values in error messages (a file and section)."""
    data: DataDir = field(default_factory=data_dir)


def resolve_values(values: Mapping[str, Any], context: InputContext) -> dict[str, Any]:
    """``values`` with absolute paths and a trace's ``workload_digest`` (see the module
    docstring); ``ValueError`` naming the source when a trace is missing or its content is not
    the digest the values pin. Values already resolved come back unchanged."""
    resolved = dict(values)
    workload = resolved.get("workload")
    if isinstance(workload, str):
        kind, colon, raw = workload.partition(":")
        if colon and raw:
            path = _trace_path(raw, context, workload)
            digest = content_digest(path)
            pinned = resolved.get("workload_digest")
            if pinned is not None and pinned != digest:
                raise ValueError(
                    f"{context.source}: the content of {path} is {digest}, not the "
                    f"workload_digest {pinned} the spec pins (the trace changed)"
                )
            resolved["workload"] = f"{kind}:{path}"
            resolved["workload_digest"] = digest
    model = resolved.get("model")
    if isinstance(model, str) and model:
        local = _absolute(Path(model).expanduser(), context.base_dir)
        if local.is_dir():
            resolved["model"] = str(local)
    return resolved


def check_workload_content(spec: Any) -> None:
    """Before a run: a trace whose spec holds a ``workload_digest`` still has that content
    (``ValueError`` if the file changed since the spec was parsed, or is gone)."""
    if spec.workload_digest is None:
        return
    path = Path(spec.workload.partition(":")[2])
    if not path.exists():
        raise ValueError(f"workload {spec.workload!r}: {path} does not exist")
    digest = content_digest(path)
    if digest != spec.workload_digest:
        raise ValueError(
            f"workload {spec.workload!r} changed since the spec was parsed: its content is "
            f"{digest}, the spec's {spec.workload_digest}; parse the spec again"
        )


def with_sampling_from_environment(
    values: Mapping[str, Any], env: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """``values`` with the sampler the ``OTEL_TRACES_SAMPLER*`` variables ask for, unless
    they name one themselves."""
    if "trace_sampler" in values or "trace_sampler_ratio" in values:
        return dict(values)
    return {**values, **from_environment(env)}


def content_digest(path: Path) -> str:
    """``sha256:<hex>`` of a file's bytes, or of a directory's files (see the module docstring)."""
    path = Path(path)
    stat = path.stat()
    if path.is_dir():
        files = sorted(
            p
            for p in path.rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
        digest = hashlib.sha256()
        for file in files:
            digest.update(file.relative_to(path).as_posix().encode() + b"\0")
            digest.update(_file_digest(str(file), *_version(file)).encode())
        return f"sha256:{digest.hexdigest()}"
    return f"sha256:{_file_digest(str(path), stat.st_size, stat.st_mtime_ns)}"


def _version(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


@functools.lru_cache(maxsize=4096)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    """The file's sha256 (hex); size and mtime key the cache, so an edited file is read again."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_READ_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _trace_path(raw: str, context: InputContext, workload: str) -> Path:
    if raw.startswith(DATA_DIR_VARIABLE):
        if context.data.path is None:
            raise ValueError(
                f"{context.source}: workload {workload!r} reads from the data directory, which "
                f"is not set: set {DATA_DIR_ENV}=DIR or pass --data-dir DIR (the directory of "
                "the public traces: mooncake/, kv-cache-tester/, ...)"
            )
        rest = raw[len(DATA_DIR_VARIABLE) :].lstrip("/")
        path = context.data.path / rest
        where = f" (the data directory is {context.data.describe()})"
    else:
        path = _absolute(Path(raw).expanduser(), context.base_dir)
        where = "" if Path(raw).is_absolute() else f" (relative to {context.base_dir})"
    if not path.exists():
        raise ValueError(f"{context.source}: workload {workload!r}: {path} does not exist{where}")
    return path
