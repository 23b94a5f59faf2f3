"""Save, set and restore object state for the length of a ``with`` block."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def swapped(obj: Any, **values: Any) -> Iterator[Any]:
    """Set attributes of ``obj`` to ``values`` inside the block and put the previous values back on exit, also
    when the block raises. Nested blocks restore in reverse order, so each sees what the enclosing one set.

    Raises AttributeError (before anything is changed) for an attribute ``obj`` does not have."""
    missing = [k for k in values if not hasattr(obj, k)]
    if missing:
        raise AttributeError(f"{type(obj).__name__} has no attribute(s) {missing}")
    prev = {k: getattr(obj, k) for k in values}
    try:
        for k, v in values.items():
            setattr(obj, k, v)
        yield obj
    finally:
        for k, v in prev.items():
            setattr(obj, k, v)
