"""Sweep files: a TOML grid of run keys, expanded into the ordered list of runs it names.

A sweep file holds ``name`` and ``description`` (both optional; the name defaults to the
file's stem and names the sweep directory), a ``[base]`` of run keys shared by every run, a
``[grid]`` of run keys to lists of values (the cartesian product, first key outermost, in
file order), ``[[exclude]]`` tables that drop the grid combinations matching all their keys,
and ``[[include]]`` tables of extra combinations (merged over ``[base]``, added after the
grid). ``workload_params`` tables merge key by key over the base's.

A grid entry whose values are tables varies several run keys *together* (one dimension of the
grid; its name is free): ``setup = [{workload = "chat", engine_blocks = 64}, {workload =
"mooncake:...", engine_blocks = 512}]`` gives each workload its own engine size.

Paths in a sweep file are relative to the file's directory (``$KVTB_DATA_DIR`` names the data
directory), made absolute and their traces hashed as the file is read
(:mod:`testbed.spec.inputs`): a missing trace fails here, before any run.

Every mistake is found before any run starts: unknown top-level keys, unknown run keys (the
message names the key, the file and section, and lists the valid keys, from
:meth:`RunSpec.from_mapping`), empty grid lists, excludes that match nothing (a misspelt
value would otherwise silently drop nothing) and invalid combinations. Combinations that
resolve to the same run (same ``run_id``) are kept once, at their first position.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from testbed.spec.inputs import (
    DataDir,
    InputContext,
    resolve_values,
    with_sampling_from_environment,
)
from testbed.spec.runspec import DERIVED_KEYS, RunSpec

TOP_LEVEL_KEYS = ("name", "description", "base", "grid", "include", "exclude")
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


@dataclass(frozen=True)
class SweepSpec:
    """A validated, expanded sweep: what ``kvtb sweep`` runs, in order."""

    name: str
    """Names the sweep directory ``OUT/<name>/``."""
    description: str
    runs: tuple[RunSpec, ...]
    """Every distinct run, grid order first, then the includes."""
    swept: tuple[str, ...]
    """Run keys whose value differs between runs (the x-axes of a report), grid keys first."""
    source_text: str = ""
    """The sweep file as written (copied into the sweep directory)."""

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise ValueError(
                f"sweep name {self.name!r} must be a plain directory name "
                "(letters, digits, '_', '-', '.'; not starting with '.' or '-')"
            )
        if not self.runs:
            raise ValueError(f"sweep {self.name!r} has no runs")
        unknown = sorted(set(self.swept) - set(RunSpec.keys()))
        if unknown:
            raise ValueError(f"swept keys {unknown} are not run keys")

    @property
    def run_ids(self) -> list[str]:
        return [run.run_id for run in self.runs]

    @property
    def label_keys(self) -> tuple[str, ...]:
        """The swept keys that tell runs apart, without those an earlier one determines (the
        other keys of a linked grid dimension): what a run's label needs."""
        kept: list[str] = []
        for key in self.swept:
            groups: dict[tuple[str, ...], set[str]] = {}
            for run in self.runs:
                groups.setdefault(tuple(repr(getattr(run, k)) for k in kept), set()).add(
                    repr(getattr(run, key))
                )
            if any(len(values) > 1 for values in groups.values()):
                kept.append(key)
        return tuple(kept)


def load_sweep(
    path: Path, data: DataDir | None = None, overrides: Mapping[str, Any] | None = None
) -> SweepSpec:
    """Reads and expands a sweep file; every error message starts with the file's path.
    ``data``: the data directory (default: :func:`testbed.spec.inputs.data_dir`);
    ``overrides``: run keys set in every run, over the file's values (``kvtb sweep --set``)."""
    path = Path(path)
    text = path.read_text()
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML: {exc}") from None
    return expand_sweep(
        document,
        source=str(path),
        default_name=path.stem,
        source_text=text,
        base_dir=path.absolute().parent,
        data=data,
        overrides=overrides,
    )


def expand_sweep(
    document: Mapping[str, Any],
    *,
    source: str,
    default_name: str,
    source_text: str = "",
    base_dir: Path | None = None,
    data: DataDir | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> SweepSpec:
    """Expands a parsed sweep document (see the module docstring) into its runs; relative
    paths in it are relative to ``base_dir`` (default: the working directory); ``overrides``
    are set in every run (relative paths in them: to the working directory)."""
    name, description = _name_and_description(document, source, default_name)
    base = _table(document.get("base", {}), f"{source} [base]")
    grid = _grid(document.get("grid", {}), f"{source} [grid]")
    excludes = _tables(document.get("exclude", []), source, "exclude")
    includes = _tables(document.get("include", []), source, "include")
    combinations = _grid_combinations(base, grid, excludes, source)
    for number, include in enumerate(includes, start=1):
        combinations.append((f"{source} [[include]] #{number}", _merge(base, include)))
    extra = _table(dict(overrides or {}), "--set")
    if extra:
        combinations = [
            (f"{where} with --set", _merge(mapping, extra)) for where, mapping in combinations
        ]
    root = Path.cwd() if base_dir is None else base_dir
    ordered = _run_specs(combinations, root, data)
    try:
        return SweepSpec(
            name=name,
            description=description,
            runs=ordered,
            swept=_swept(ordered, _grid_keys(grid)),
            source_text=source_text,
        )
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None


def _name_and_description(
    document: Mapping[str, Any], source: str, default_name: str
) -> tuple[str, str]:
    """The sweep's name (``default_name`` when it has none) and description (``""``);
    ``ValueError`` for an unknown top-level key or a name or description not a string."""
    unknown = sorted(set(document) - set(TOP_LEVEL_KEYS))
    if unknown:
        raise ValueError(
            f"{source}: unknown top-level key{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(map(repr, unknown))}; valid keys: {', '.join(TOP_LEVEL_KEYS)}"
        )
    name = document.get("name", default_name)
    description = document.get("description", "")
    for key, value in (("name", name), ("description", description)):
        if not isinstance(value, str):
            raise ValueError(f"{source}: {key} must be a string, got {value!r}")
    return name, description


def _grid_combinations(
    base: Mapping[str, Any],
    grid: Mapping[str, list[Any]],
    excludes: list[dict[str, Any]],
    source: str,
) -> list[tuple[str, dict[str, Any]]]:
    """Every grid point merged over ``base``, in the grid's order, but those an exclude matches,
    each with where it came from; ``ValueError`` for an exclude that matches none."""
    combinations: list[tuple[str, dict[str, Any]]] = []
    matched = [False] * len(excludes)
    for point_values in itertools.product(*grid.values()):
        point = dict(zip(grid, point_values, strict=True))
        merged = _merge(base, _flatten(point))
        hits = [_matches(merged, exclude) for exclude in excludes]
        matched = [m or h for m, h in zip(matched, hits, strict=True)]
        if not any(hits):
            combinations.append((f"{source} [grid] combination {_describe(point)}", merged))
    for number, (exclude, found) in enumerate(zip(excludes, matched, strict=True), start=1):
        if not found:
            raise ValueError(
                f"{source} [[exclude]] #{number}: {_describe(exclude)} matches no grid combination"
            )
    return combinations


def _run_specs(
    combinations: list[tuple[str, dict[str, Any]]], root: Path, data: DataDir | None
) -> tuple[RunSpec, ...]:
    """Each combination's run (inputs resolved against ``root``), in order, each distinct run
    once (the first of those with the same run id)."""
    runs: dict[str, RunSpec] = {}
    for where, mapping in combinations:
        context = InputContext(root, where) if data is None else InputContext(root, where, data)
        values = with_sampling_from_environment(resolve_values(mapping, context))
        spec = RunSpec.from_mapping(values, source=where)
        runs.setdefault(spec.run_id, spec)
    return tuple(runs.values())


def _table(value: Any, where: str) -> dict[str, Any]:
    """A table of run keys; unknown keys fail here, naming the section (values: per run)."""
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a table of run keys, got {value!r}")
    unknown = sorted(set(value) - set(RunSpec.keys()))
    if unknown:
        # RunSpec.from_mapping words the message (key, source, valid keys) for every section alike.
        RunSpec.from_mapping({key: value[key] for key in unknown}, source=where)
    return dict(value)


def _grid(value: Any, where: str) -> dict[str, list[Any]]:
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a table of run keys, got {value!r}")
    for key, values in value.items():
        if not isinstance(values, list):
            raise ValueError(f"{where}: {key} must be a list of values, got {values!r}")
        if not values:
            raise ValueError(f"{where}: {key} is an empty list; give at least one value")
        if all(isinstance(item, dict) for item in values):  # run keys varied together
            for number, item in enumerate(values, start=1):
                _table(item, f"{where} {key} #{number}")
        else:
            _table({key: values}, where)  # an unknown run key fails here
    return dict(value)


def _flatten(point: Mapping[str, Any]) -> dict[str, Any]:
    """A grid point's run keys: linked dimensions (tables) contribute all their keys."""
    flat: dict[str, Any] = {}
    for key, value in point.items():
        if isinstance(value, dict) and key != "workload_params":
            flat.update(value)
        else:
            flat[key] = value
    return flat


def _grid_keys(grid: Mapping[str, list[Any]]) -> list[str]:
    keys: list[str] = []
    for key, values in grid.items():
        linked = all(isinstance(item, dict) for item in values) and key != "workload_params"
        for name in [k for item in values for k in item] if linked else [key]:
            if name not in keys:
                keys.append(name)
    return keys


def _tables(value: Any, source: str, section: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise ValueError(
            f"{source}: {section} must be an array of tables ([[{section}]]), got {value!r}"
        )
    tables = [
        _table(item, f"{source} [[{section}]] #{number}")
        for number, item in enumerate(value, start=1)
    ]
    for number, table in enumerate(tables, start=1):
        if not table:
            raise ValueError(f"{source} [[{section}]] #{number} is empty")
    return tables


def _merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    merged = {**base, **override}
    if isinstance(base.get("workload_params"), dict) and isinstance(
        override.get("workload_params"), dict
    ):
        merged["workload_params"] = {**base["workload_params"], **override["workload_params"]}
    return merged


_DEFAULTS = RunSpec().to_dict()


def _matches(values: Mapping[str, Any], exclude: Mapping[str, Any]) -> bool:
    """Whether a combination has every value of ``exclude`` (keys it leaves out: the defaults)."""
    return all(values.get(key, _DEFAULTS[key]) == value for key, value in exclude.items())


def _swept(runs: tuple[RunSpec, ...], grid_keys: list[str]) -> tuple[str, ...]:
    varying = [
        field.name
        for field in dataclasses.fields(RunSpec)
        if field.name not in DERIVED_KEYS
        and len({repr(getattr(run, field.name)) for run in runs}) > 1
    ]
    return tuple(
        [key for key in grid_keys if key in varying]
        + [key for key in varying if key not in grid_keys]
    )


def _describe(values: Mapping[str, Any]) -> str:
    return "{" + ", ".join(f"{key} = {value!r}" for key, value in values.items()) + "}"
