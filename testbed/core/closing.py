"""The context-manager protocol of an object that holds resources until its ``close()``.

``with Thing(...) as thing:`` hands out ``thing`` and closes it on the way out, exceptions
included (they propagate). A subclass defines :meth:`Closing.close` only."""

from __future__ import annotations

from typing import Self


class Closing:
    """Base of objects closed by :meth:`close`; ``with`` closes them."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
