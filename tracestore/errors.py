"""Exceptions raised by tracestore.

Every error a caller can act on has its own type; all derive from :class:`TraceStoreError`. Messages say what
arrived and what is allowed, and name the store URL, the object key and the trajectory where they are known.
Errors caused by another exception are raised ``from`` it so that the cause stays visible.
"""

from __future__ import annotations

__all__ = [
    "TraceStoreError",
    "SchemaVersionError",
    "IntegrityError",
    "HintNotFoundError",
    "OverlapError",
    "InvalidIdError",
    "ShapeError",
    "DTypeError",
    "UnknownSiteError",
    "StoreExistsError",
    "StoreNotFoundError",
    "SnapshotError",
    "BackendError",
    "ObjectNotFoundError",
]


class TraceStoreError(Exception):
    """Base class of every error raised by tracestore."""


class SchemaVersionError(TraceStoreError):
    """A manifest, log entry, snapshot or cursor declares a format version this code does not support."""


class IntegrityError(TraceStoreError):
    """Stored bytes fail a check: crc32c mismatch, truncated or undecodable object, missing committed data."""


class HintNotFoundError(TraceStoreError, KeyError):
    """A requested trajectory or token position is not committed (in the reader's snapshot)."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


class OverlapError(TraceStoreError):
    """A token range overlaps one already committed (or buffered) for the same trajectory."""

    def __init__(self, message: str, conflicts: list[tuple[str, int, int]] | None = None):
        super().__init__(message)
        #: the rejected ``(traj_id, token_start, token_stop)`` ranges
        self.conflicts: list[tuple[str, int, int]] = list(conflicts or [])


class InvalidIdError(TraceStoreError, ValueError):
    """A trajectory, writer or site id does not match the allowed pattern (it could escape the store root)."""


class ShapeError(TraceStoreError, ValueError):
    """An array has the wrong shape (rows, width) or a slice/range is out of bounds or misaligned."""


class DTypeError(TraceStoreError, TypeError):
    """An array has a dtype that cannot be stored losslessly in the declared column."""


class UnknownSiteError(TraceStoreError, KeyError):
    """A site (or MoE layer) name that the store does not declare."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class StoreExistsError(TraceStoreError, FileExistsError):
    """``create_store`` found a store at the URL (and ``exist_ok`` was false or the declaration differs)."""


class StoreNotFoundError(TraceStoreError, FileNotFoundError):
    """No store manifest at the URL."""


class SnapshotError(TraceStoreError, ValueError):
    """A snapshot or cursor is malformed, belongs to another store, or points past the end of the log."""


class BackendError(TraceStoreError, OSError):
    """The storage backend failed (I/O error, permission, unsupported operation)."""


class ObjectNotFoundError(BackendError, FileNotFoundError):
    """A backend object does not exist (internal; public APIs translate it to a more specific error)."""
