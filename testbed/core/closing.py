"""One lifecycle for resources that hold something until closed: ``close()``, and ``with``.

Servers, clients, mappings and exports release what they hold in ``close()`` and are their
own context managers (STYLE: explicit lifecycle, no ``atexit``). :class:`Closing` writes the
context-manager half once; a resource subclasses it and defines ``close()``.
"""

from __future__ import annotations

from typing import Self


class Closing:
    """A resource that :meth:`close` releases: ``with Resource(...) as resource:`` closes it
    on the way out, whatever happened inside."""

    def close(self) -> None:
        """Releases what the resource holds (subclasses define it)."""
        raise NotImplementedError

    def __enter__(self) -> Self:
        """The resource itself."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Closes the resource; exceptions raised inside propagate."""
        self.close()
