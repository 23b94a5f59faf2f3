"""The storage-backend interface: a small key/value object store with one atomic primitive.

Modelled on zarr-python's ``zarr.abc.store.Store``: the interface lives here, the implementations are private
modules (``_local``, ``_memory``, ``_fsspec``; :func:`~tracestore.storage.open_backend` in ``_open`` picks one for a
URL) and all of them pass one shared test suite. Nothing here imports an implementation. Keys are relative,
``/``-separated object names below the store root (``log/000000000007.arrow``); they never start with ``/`` and
never contain ``..`` (tracestore builds them only from validated ids).

What the store needs from a backend:

* ``put`` — whole-object write; readers never observe a partial object (local: ``.<name>.<uuid>.partial``
  then ``os.replace``; object stores: a single PUT).
* ``put_if_absent`` — atomic create-if-absent, the only synchronisation primitive of the commit protocol
  (local: ``os.link`` of a finished ``.partial`` file, which fails if the target exists; S3: ``PUT`` with
  ``If-None-Match: *``).
* ``get`` / ``get_range`` / ``get_ranges`` — whole object or byte ranges ``[start, stop)``.
* ``list`` / ``list_after`` — a fresh listing (caches bypassed), ``exists``, ``delete``.

"Absent" and "could not tell" are different answers: ``exists`` returns False and ``get`` raises
:class:`~tracestore.errors.ObjectNotFoundError` only when the storage said the object does not exist. Every other
failure is retried (transient ones: throttling, 5xx, timeouts, resets, refused connections) under the backend's
:class:`RetryPolicy` and then raised as a typed :class:`~tracestore.errors.BackendError` subclass naming the URL,
the object and the cause in one line.
"""

from __future__ import annotations

import abc
import logging
import math
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from ..errors import (
    BackendError,
    ObjectNotFoundError,
    OptionError,
    StorageTimeoutError,
    TraceStoreError,
    TransientStorageError,
)

__all__ = ["Backend", "ByteRange", "ObjectInfo", "RetryPolicy", "join_parts", "Data", "PARTIAL_SUFFIX", "DEFAULT_RETRY"]

T = TypeVar("T")

#: temporary objects written by the local backend before an atomic rename/link; never part of the format
PARTIAL_SUFFIX = ".partial"

#: what ``put`` accepts: one bytes-like object, or a list of them to be concatenated
Data = bytes | bytearray | memoryview | Sequence[bytes | bytearray | memoryview]


def join_parts(data: Data) -> bytes:
    """Concatenate a gather list (or return a single bytes-like object as bytes)."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    return b"".join(data)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ByteRange:
    """Bytes ``[start, stop)`` of object ``key``."""

    key: str
    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """One listed object: key relative to the root, size in bytes, modification time (unix seconds)."""

    key: str
    size: int
    mtime: float


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How a backend retries transient storage errors: at most ``attempts`` tries of one operation, sleeping a
    random ("full jitter") time in ``[0, min(max_delay_s, base_delay_s * 2**k)]`` after the k-th failure, and never
    past ``deadline_s`` from the first try. Errors that are not transient (absent, denied, bad credentials,
    integrity) are raised at once.

    Raises:
        OptionError (a ValueError): ``attempts < 1`` or a delay/deadline that is negative, NaN or infinite.
    """

    attempts: int = 5
    base_delay_s: float = 0.1
    max_delay_s: float = 5.0
    deadline_s: float = 60.0

    def __post_init__(self) -> None:
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int) or self.attempts < 1:
            raise OptionError(f"RetryPolicy.attempts must be an int >= 1, got {self.attempts!r}")
        for name in ("base_delay_s", "max_delay_s", "deadline_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise OptionError(f"RetryPolicy.{name} must be a finite number >= 0, got {v!r}")

    def delay(self, failures: int) -> float:
        """Seconds to sleep after ``failures`` consecutive failures (>= 1)."""
        return random.uniform(0.0, min(self.max_delay_s, self.base_delay_s * 2.0 ** (failures - 1)))


#: what a backend uses when none is given
DEFAULT_RETRY = RetryPolicy()


class Backend(abc.ABC):
    """Abstract object store rooted at :attr:`url`.

    Capabilities are flags (zarr style): :attr:`supports_put_if_absent` (required for writers),
    :attr:`supports_listing` (required for ``gc``/``verify``/``info``).
    """

    url: str
    supports_put_if_absent: bool = True
    supports_listing: bool = True
    retry: RetryPolicy = DEFAULT_RETRY

    def classify(self, error: BaseException, what: str) -> BackendError:
        """The typed error for a failure of operation ``what`` (e.g. ``"GET 'log/000000000007.arrow'"``).
        Backends override this to recognise their storage's errors; the default wraps anything as BackendError."""
        if isinstance(error, BackendError):
            return error
        return BackendError(f"{what} in {self.url} failed: {type(error).__name__}: {error}")

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` under :attr:`retry`: transient failures are retried with backoff until the attempts or the
        deadline run out, then raised as :class:`TransientStorageError` (with the attempt count); other failures
        are raised at once, typed by :meth:`classify`."""
        policy = self.retry
        start = time.monotonic()
        failures = 0
        while True:
            try:
                return fn()
            except TraceStoreError as e:
                err: BackendError | TraceStoreError = e
            except Exception as e:  # noqa: BLE001 - storage clients raise anything; classify() types it
                err = self.classify(e, what)
                err.__cause__ = e
            if not isinstance(err, TransientStorageError):
                raise err
            failures += 1
            pause = policy.delay(failures)
            elapsed = time.monotonic() - start
            if failures >= policy.attempts or elapsed + pause > policy.deadline_s:
                if failures > 1:
                    kind = type(err)
                    if elapsed + pause > policy.deadline_s and failures < policy.attempts:
                        kind = StorageTimeoutError
                    again = kind(f"{err} (gave up after {failures} attempts in {elapsed:.1f} s)")
                    again.__cause__ = err.__cause__
                    raise again
                raise err
            log.debug("%s in %s: transient failure %d/%d (%s); retrying in %.2f s", what, self.url, failures,
                      policy.attempts, err, pause)
            time.sleep(pause)

    @abc.abstractmethod
    def get(self, key: str) -> bytes:
        """Whole object. Raises ObjectNotFoundError if absent, BackendError on I/O failure."""

    @abc.abstractmethod
    def get_range(self, key: str, start: int, stop: int) -> bytes:
        """Bytes ``[start, stop)``; shorter if the object is shorter. Raises ObjectNotFoundError if absent."""

    def get_ranges(self, ranges: Sequence[ByteRange]) -> list[bytes]:
        """Many ranges (possibly of many objects), in order. Backends override this to fetch concurrently."""
        return [self.get_range(r.key, r.start, r.stop) for r in ranges]

    #: ranges of one object closer than this are fetched with one request (object stores: fewer GETs)
    coalesce_gap: int = 1 << 20
    coalesce_max: int = 64 << 20

    def readinto_ranges(self, requests: Sequence[tuple[ByteRange, Sequence[memoryview]]],
                        done: Callable[[int, int], None] | None = None) -> list[int]:
        """Scatter-read: fill each request's buffers, in order, from its byte range (the buffers' sizes add up to
        the range's length). Returns the number of bytes read per request (less than the range if the object is
        shorter); ``done(k, nread)``, if given, is called as soon as request ``k`` has been filled (its buffers are
        not touched again): once per request, not necessarily in request order, and possibly from several threads
        at once for different requests (the local backend reads large calls on several threads). Nearby ranges of
        one object are coalesced into one ``get_ranges`` request; local files read straight into the buffers
        (``preadv``)."""
        order = sorted(range(len(requests)), key=lambda k: (requests[k][0].key, requests[k][0].start))
        groups: list[list] = []  # [key, start, stop, [request index, ...]]
        for k in order:
            r = requests[k][0]
            g = groups[-1] if groups else None
            if (g is not None and g[0] == r.key and r.start - g[2] <= self.coalesce_gap
                    and max(g[2], r.stop) - g[1] <= self.coalesce_max):
                g[2] = max(g[2], r.stop)
                g[3].append(k)
            else:
                groups.append([r.key, r.start, r.stop, [k]])
        datas = self.get_ranges([ByteRange(g[0], g[1], g[2]) for g in groups])
        counts = [0] * len(requests)
        for g, data in zip(groups, datas):
            whole = memoryview(data)
            for k in g[3]:
                r, bufs = requests[k]
                view = whole[max(0, r.start - g[1]) : max(0, r.stop - g[1])]
                pos = 0
                for b in bufs:
                    n = min(len(b), len(view) - pos)
                    if n <= 0:
                        break
                    b[:n] = view[pos : pos + n]
                    pos += n
                counts[k] = pos
                if done is not None:
                    done(k, pos)
        return counts

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """Many whole objects; ``None`` for absent ones."""
        out: list[bytes | None] = []
        for key in keys:
            try:
                out.append(self.get(key))
            except ObjectNotFoundError:
                out.append(None)
        return out

    @abc.abstractmethod
    def put(self, key: str, data: Data) -> None:
        """Create or replace an object atomically (no reader sees a partial object).

        ``data`` is bytes-like or a sequence of bytes-like parts that are concatenated (gather write)."""

    def put_many(self, items: Mapping[str, Data], *, atomic: bool = True) -> None:
        """Write many objects (no ordering guarantee between them). Backends override to write concurrently.

        ``atomic=False`` allows a backend to skip its atomic-rename step for objects that are new (never
        existed) and that no reader opens before a later commit references them (segment data)."""
        for key, data in items.items():
            self.put(key, data)

    @abc.abstractmethod
    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create the object atomically iff it does not exist. True if created, False if it already existed."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """Whether the object exists, asked of the storage itself (no listing cache)."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """All objects whose key starts with ``prefix`` (a fresh listing), sorted by key."""

    def list_after(self, prefix: str, start_after: str, limit: int = 1000) -> list[str]:
        """Up to ``limit`` keys that start with ``prefix`` and sort after ``start_after``, ascending (a fresh
        listing). Object stores answer this with one request (S3 ``StartAfter``); the default lists the prefix."""
        return [o.key for o in self.list(prefix) if o.key > start_after][:limit]

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Delete an object; absent objects are ignored."""

    def delete_many(self, keys: Iterable[str]) -> None:
        for key in keys:
            self.delete(key)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (thread pools, sessions)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


def _check_key(key: str) -> None:
    # internal invariant: keys are built from validated ids only
    assert key and not key.startswith("/") and ".." not in key.split("/"), key
