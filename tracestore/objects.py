"""Side objects: what an application keeps beside a store, in an *area* of the store's URL (FORMAT §2).

A store owns the top-level names ``tracestore.json``, ``log/``, ``data/`` and ``index/`` of its URL; every other
top-level name is an application's, and no ``gc``, ``verify`` or ``compact`` reads, changes or deletes it. tracerl
keeps policy versions under ``weights/``, trainer checkpoints under ``checkpoints/``, recorded code tables under
``audit/`` and the SGLang plugin's quantizer records under ``quantizer/`` (:data:`RESERVED_AREAS`)::

    with ts.open_area("s3://bucket/run1", "weights") as area:      # or store.area("weights")
        area.put("000000000007.safetensors", blob)
        if not area.put_if_absent("000000000007.json", sidecar):  # the commit: create-if-absent
            raise FileExistsError(area.describe("000000000007.json"))
        names = [o.key for o in area.list()]                       # ["000000000007.json", ...]

An :class:`ObjectArea` is a thin layer over the store's backend: every call goes through the backend's retries
(:class:`~tracestore.storage.RetryPolicy`) and raises its typed :class:`~tracestore.errors.BackendError`
subclasses; a storage error is never read as "absent". Names are checked before any I/O (:func:`check_object_name`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from ._closing import Closing
from .errors import InvalidIdError, ObjectNotFoundError, OptionTypeError, TransientStorageError
from .format.keys import MANIFEST_KEY, STORE_NAMES
from .storage import PARTIAL_SUFFIX, Backend, ByteRange, Data, ObjectInfo, RetryPolicy, join_parts, open_backend

__all__ = ["ObjectArea", "open_area", "RESERVED_AREAS", "check_area", "check_object_name"]

#: the application areas tracerl uses beside its stores: policy versions, trainer checkpoints, audit code tables,
#: the SGLang plugin's quantizer records
RESERVED_AREAS: tuple[str, ...] = ("weights", "checkpoints", "audit", "quantizer")

AREA_PATTERN = r"[a-z][a-z0-9_-]{0,63}"
_AREA_RE = re.compile(AREA_PATTERN)
#: longest object name (S3 keys are at most 1,024 bytes, and the URL's own prefix needs some of them)
MAX_NAME_BYTES = 512
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f\\]")


def check_area(area: object) -> str:
    """Validate an area name: ``[a-z][a-z0-9_-]{0,63}`` and none of the names the store format owns.

    Raises:
        InvalidIdError: anything else (says what arrived and what is allowed).
    """
    if area in STORE_NAMES:
        raise InvalidIdError(f"area name {area!r}: {', '.join(n for n in STORE_NAMES if n != MANIFEST_KEY)} and "
                             f"{MANIFEST_KEY} belong to the store format (FORMAT §2); use another name (e.g. "
                             f"{', '.join(RESERVED_AREAS)})")
    if not isinstance(area, str) or not _AREA_RE.fullmatch(area):
        raise InvalidIdError(f"area name {area!r:.80}: allowed are 1-64 characters of [a-z0-9_-] starting with a "
                             f"letter (e.g. {', '.join(RESERVED_AREAS)})")
    return area


def check_object_name(name: object, what: str = "object name") -> str:
    """Validate an object name inside an area: a relative ``/``-separated name (``000000000007.json``,
    ``run1/report.html``) without empty parts, ``.`` or ``..`` parts, a leading ``/``, control characters or ``\\``,
    a ``.partial`` suffix (temporary files of unfinished writes), of at most 512 bytes UTF-8.

    Raises:
        InvalidIdError: anything else (says what arrived and what is allowed).
    """
    allowed = (f"a relative '/'-separated name of at most {MAX_NAME_BYTES} bytes without empty, '.' or '..' parts, "
               f"control characters, backslashes or a '{PARTIAL_SUFFIX}' suffix")
    if not isinstance(name, str):
        raise InvalidIdError(f"{what} must be a str, got {type(name).__name__} {name!r:.80}")
    parts = name.split("/")
    if (not name or len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES or _CONTROL_RE.search(name)
            or any(p in ("", ".", "..") for p in parts) or name.endswith(PARTIAL_SUFFIX)):
        raise InvalidIdError(f"invalid {what} {name!r:.120}: allowed is {allowed}")
    return name


def _check_prefix(prefix: object) -> str:
    """A listing prefix: empty, or the start of an object name (it may end inside a part or with ``/``)."""
    if prefix == "":
        return prefix
    if not isinstance(prefix, str):
        raise InvalidIdError(f"listing prefix must be a str, got {type(prefix).__name__} {prefix!r:.80}")
    check_object_name(prefix[:-1] if prefix.endswith("/") else prefix, "listing prefix")
    return prefix


class ObjectArea(Closing):
    """The objects of one application area (``<url>/<area>/``): see the module docstring.

    Attributes:
        url: the location URL as given (a store URL, or any directory or prefix URL). area: the area's name.
    """

    def __init__(self, backend: Backend, url: str, area: str, *, owned: bool = False):
        self.url = url
        self.area = check_area(area)
        self._backend = backend
        self._owned = owned  # close() closes the backend only if this area opened it

    def __repr__(self) -> str:
        return f"ObjectArea({self.url!r}, {self.area!r})"

    def close(self) -> None:
        """Close the backend if :func:`open_area` opened it (an area of a :class:`~tracestore.Store` shares the
        store's backend and leaves it open)."""
        if self._owned:
            self._owned = False
            self._backend.close()

    def key(self, name: str) -> str:
        """``<area>/<name>``: the object's key below :attr:`url` (for messages). Raises InvalidIdError."""
        return f"{self.area}/{check_object_name(name)}"

    def describe(self, name: str) -> str:
        """``<url>/<area>/<name>``, for error messages."""
        return f"{self.url}/{self.area}/{name}"

    def put(self, name: str, data: Data) -> None:
        """Create or replace the object atomically (readers never see part of it). ``data``: bytes-like, or a list
        of bytes-like parts written as their concatenation."""
        self._backend.put(self.key(name), data)

    def put_if_absent(self, name: str, data: Data) -> bool:
        """Create the object atomically iff it does not exist: True if this call created it, False if another
        object is there (an application's commit point: the object of the first writer wins).

        An ambiguous outcome — the request was applied but the client saw an error, or its retry was answered
        "exists" — is resolved as the commit log resolves its entries (FORMAT §4): by reading the object back.
        It holds exactly ``data``: True; other bytes: False. When it cannot be read back after a failed request,
        the failure is raised (the outcome is unknown, the object may still appear).

        Raises:
            TransientStorageError (and subclasses): the storage kept failing and the outcome is unknown.
            BackendError: any other storage failure.
        """
        key = self.key(name)
        failure: TransientStorageError | None = None
        try:
            if self._backend.put_if_absent(key, data):
                return True
        except TransientStorageError as e:
            failure = e
        try:
            existing = self._backend.get(key)
        except ObjectNotFoundError:
            if failure is not None:
                raise failure from None
            return False  # it existed when asked and was deleted since: not created by this call
        return existing == join_parts(data)

    def get(self, name: str) -> bytes:
        """The object's bytes. Raises ObjectNotFoundError only when the storage says it is absent, another
        BackendError subclass when the storage failed."""
        return self._backend.get(self.key(name))

    def read_into(self, name: str, buffer) -> int:
        """Fill ``buffer`` (a writable bytes-like object) with the object's first ``len(buffer)`` bytes, straight
        into it where the storage can (local files: ``preadv``, large objects on several threads); returns the bytes
        read, fewer when the object is shorter. Raises ObjectNotFoundError only when the storage says the object is
        absent, another BackendError subclass when the storage failed, OptionTypeError (before any I/O) for a
        ``buffer`` that is not a writable bytes-like object."""
        try:
            view = memoryview(buffer).cast("B")
        except TypeError as e:
            raise OptionTypeError(f"read_into needs a writable bytes-like buffer, got {type(buffer).__name__} "
                                  f"({e})") from None
        if view.readonly:
            raise OptionTypeError(f"read_into needs a writable buffer, got a read-only {type(buffer).__name__}")
        return self._backend.readinto_ranges([(ByteRange(self.key(name), 0, len(view)), [view])])[0]

    def exists(self, name: str) -> bool:
        """Whether the object exists, asked of the storage (no listing cache). Raises BackendError on failure."""
        return self._backend.exists(self.key(name))

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """The area's objects whose name starts with ``prefix``, from a fresh listing (no cache), sorted by name;
        :attr:`ObjectInfo.key` is the name relative to the area (``000000000007.json``). Temporary files of
        unfinished writes are left out."""
        base = f"{self.area}/"
        return [ObjectInfo(o.key[len(base):], o.size, o.mtime) for o in self._backend.list(base + _check_prefix(prefix))
                if not o.key.endswith(PARTIAL_SUFFIX)]

    def delete(self, name: str) -> None:
        """Delete the object; an absent one is fine."""
        self._backend.delete(self.key(name))

    def delete_many(self, names: Iterable[str]) -> None:
        """Delete many objects (absent ones are fine); every name is checked before the first deletion."""
        self._backend.delete_many([self.key(n) for n in names])


def open_area(url: str, area: str, *, storage_options: Mapping | None = None,
              retry: RetryPolicy | None = None) -> ObjectArea:
    """The application area ``area`` of the location ``url`` (a store URL, or any directory or prefix URL: the
    area works without a store there), on a backend of its own that :meth:`ObjectArea.close` closes.

    ``storage_options`` and ``retry`` as for :func:`~tracestore.open_store`. The names are checked before the
    backend is opened.

    Raises:
        InvalidIdError: a bad area name. BackendError: the URL's protocol cannot be opened.
    """
    check_area(area)
    return ObjectArea(open_backend(url, storage_options, retry=retry), url, area, owned=True)
