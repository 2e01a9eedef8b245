"""The canonical sweep files shipped with the package: ``experiments/*.toml`` of the source
tree, installed as the ``experiments`` package's data, so that ``kvtb demo`` and
``kvtb sweep chunk_size`` work from a wheel outside the checkout too."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

PACKAGE = "experiments"


def experiments_dir() -> Path:
    """The directory holding the shipped sweep files."""
    root = resources.files(PACKAGE)
    if not isinstance(root, Path):  # a zipped install; the package is always installed unzipped
        raise FileNotFoundError(f"the {PACKAGE} package is not a directory: {root}")
    return root


def names() -> list[str]:
    """The shipped sweeps' names (file names without ``.toml``), sorted."""
    return sorted(path.stem for path in experiments_dir().glob("*.toml"))


def experiment_path(name: str) -> Path:
    """The shipped sweep file called ``name`` (``chunk_size`` or ``chunk_size.toml``)."""
    path = experiments_dir() / f"{name.removesuffix('.toml')}.toml"
    if not path.is_file():
        raise FileNotFoundError(
            f"no sweep file {name!r}: neither a file nor one of the shipped sweeps "
            f"({', '.join(names())})"
        )
    return path


def resolve_sweep_file(file: Path) -> Path:
    """``file`` if it exists, else the shipped sweep of that name (``kvtb sweep chunk_size``)."""
    if file.exists() or file.parent != Path("."):
        return file
    return experiment_path(file.name)
