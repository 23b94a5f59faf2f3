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
    "TransientStorageError",
    "ThrottledError",
    "StorageTimeoutError",
    "EndpointError",
    "CredentialsError",
    "AccessDeniedError",
    "LocationError",
    "CommitError",
    "DeclarationError",
    "GcRefusedError",
    "ResultExistsError",
    "TrajectoryCompleteError",
    "GcFenceError",
    "UsageError",
    "OptionError",
    "OptionTypeError",
    "ResultError",
    "EntryVersionError",
    "ArrowOverflowError",
    "BenchError",
    "SiteEncodingError",
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


class SiteEncodingError(ShapeError):
    """A write gives a site's payload in the form of the other hint encoding (FORMAT §2.5): hints/scales for a site
    with ``hint_encoding`` ``margin`` (it takes ``rows=``), or rows for a ``bits`` site."""


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
    """A backend object does not exist (internal; public APIs translate it to a more specific error).

    Raised only when the storage answered "absent" (local ENOENT, S3 404 NoSuchKey); a storage that could not
    be asked raises a :class:`TransientStorageError` or another :class:`BackendError` instead, never this."""


class TransientStorageError(BackendError):
    """The storage could not answer now (throttling, 5xx, timeout, connection reset or refused) and kept failing
    through the retries and the deadline. The operation's outcome is unknown; nothing was read as absent."""


class ThrottledError(TransientStorageError):
    """The storage asked to slow down (S3 503 SlowDown / ServiceUnavailable, 429) through every retry."""


class StorageTimeoutError(TransientStorageError, TimeoutError):
    """A request or the operation's deadline timed out."""


class EndpointError(TransientStorageError, ConnectionError):
    """The storage endpoint could not be reached, or closed or reset the connection."""


class CredentialsError(BackendError, PermissionError):
    """No credentials, or credentials the storage rejects (unknown key, bad signature, expired token)."""


class AccessDeniedError(BackendError, PermissionError):
    """The credentials are valid but not allowed to do this (S3 403 AccessDenied, local EACCES/EPERM)."""


class LocationError(BackendError):
    """The store URL cannot hold a store: the bucket does not exist, the path is not a directory, or a parent
    cannot be created."""


class CommitError(TransientStorageError):
    """A writer could not claim a log position before its commit deadline (the storage kept failing); the rows
    stay buffered and a later ``flush`` retries them."""


class DeclarationError(TraceStoreError, ValueError):
    """A store declaration or manifest value is invalid (site table, layout, MoE declaration, gc grace period,
    name template): the message says which value arrived and what is allowed."""


class GcRefusedError(TraceStoreError, ValueError):
    """``collect_garbage`` refused to delete anything: its grace period is not a finite number > 0, or shorter than
    the store's ``gc_grace_s`` without ``force``."""


class GcFenceError(CommitError):
    """``collect_garbage`` could not commit the gc entry that names the segments it is about to delete (the storage
    kept failing until its deadline); nothing was deleted."""


class ResultExistsError(OverlapError):
    """A trajectory already has a result (committed, or buffered by this writer): a trajectory is complete once,
    with one result. ``.conflicts`` lists ``(traj_id, 0, 0)`` for each refused result."""


class TrajectoryCompleteError(OverlapError):
    """Tokens for a trajectory whose result is committed (or buffered by this writer): a trajectory is complete once,
    and no token follows its result (FORMAT §3.2). ``.conflicts`` lists the refused ``(traj_id, token_start,
    token_stop)`` ranges."""


class UsageError(TraceStoreError, ValueError):
    """Bad command-line input that argparse cannot catch (malformed JSON, an unreadable file, a URL the command
    cannot use): the command prints one line and exits 2 (``tracestore.cliargs``)."""


class OptionError(TraceStoreError, ValueError):
    """An argument or option of a tracestore call is outside what it allows (a retry policy's attempts or delays,
    a writer's buffer sizes and timeouts, a read's output format, a benchmark's sizes): the message says which,
    what arrived and what is allowed."""


class OptionTypeError(OptionError, TypeError):
    """An argument of a tracestore call has a type the call cannot take (model metadata that is not JSON, a
    :class:`~tracestore.CommittedResult` given to ``Stream.read``); also an :class:`OptionError`."""


class ResultError(TraceStoreError, ValueError, TypeError):
    """A trajectory result field is invalid (FORMAT §3.2: a reward that is not finite, a negative length, an
    ``extra`` that is not a JSON object of at most 16 KiB, ...): the message says which field, what arrived and what
    is allowed. A ValueError, and a TypeError as the field checks raised for values of the wrong type before."""


class EntryVersionError(IntegrityError, ValueError):
    """A log holds an entry its store's format version cannot hold (a results entry in a version-1 store), so it
    cannot be written in that version (a version-1 checkpoint)."""


class ArrowOverflowError(ShapeError, OverflowError):
    """A batch is too large for one Arrow binary column (offsets are int32: at most 2 GiB of hint or scale bytes);
    convert fewer tokens at a time."""


class BenchError(TraceStoreError, RuntimeError):
    """The store benchmark could not set up what it measures against (the moto S3 server did not start)."""
