"""``with obj:`` for the objects that hold resources (stores, writers, object areas): the block ends with
``obj.close()``, whether it finished or raised."""

from __future__ import annotations

from typing import Self


class Closing:
    """Mixin: a context manager that returns itself and calls :meth:`close` on exit."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        raise NotImplementedError
