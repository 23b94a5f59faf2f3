"""Immutable JSON commit objects (a policy version's sidecar, a checkpoint's manifest): the one reader both use,
and the checksums of the blobs they commit.

A blob reference is ``{"key": "<stem>-<checksum[:16]>.<suffix>", "<algorithm>": "<hex>", "bytes": n}``. Format 1
of both objects used sha256; format 2 uses crc32c, the store's own checksum (hardware crc32c runs at ~10 GB/s,
sha256 at ~0.8-2 GB/s: for a 9 GB policy version that is ~1 s instead of 5-11 s at each end, which paced the
two-GPU loop). The checksum guards against torn, truncated or flipped bytes, not against a hostile writer: the
store and the weights share one trust model. Readers read both formats.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import re
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import crc32c as _crc32c

import tracestore as ts
from tracerl.errors import ConfigError

#: where an artifact lives: a URL (a store's, or any directory or prefix), an open store, or an open area
Location = str | ts.Store | ts.ObjectArea


@contextlib.contextmanager
def opened(location: Location, area: str, storage_options: Mapping | None = None) -> Iterator[ts.ObjectArea]:
    """The application area ``area`` of ``location`` for the block (`tracestore.ObjectArea`: the store's retries
    and typed errors); an area opened here is closed after the block, one that was given is left open.

    Raises ConfigError for an open area of another name."""
    if isinstance(location, ts.ObjectArea):
        if location.area != area:
            raise ConfigError(f"{location!r} is the {location.area!r} area; this needs the {area!r} area")
        yield location
    elif isinstance(location, ts.Store):
        yield location.area(area)
    else:
        with ts.open_area(location, area, storage_options=storage_options) as opened_area:
            yield opened_area


@dataclasses.dataclass(frozen=True)
class NumberedObjects:
    """A family of numbered commit objects in one application area (policy versions, checkpoints)::

        <area>/<n, 12 digits>.json                   the commit object (JSON), created with put-if-absent
        <area>/<n, 12 digits>-<checksum>.<suffix>    the blobs it commits (their keys below the location are in it)

    ``what`` names a number in messages ("policy version", "checkpoint step")."""

    area: str
    what: str
    digits: int = 12

    def check(self, n: Any) -> int:
        """``n`` if it is an int in [0, 10^digits); else ConfigError."""
        return check_number(n, self.digits, self.what)

    def commit_name(self, n: int) -> str:
        """The commit object's name in the area: ``000000000007.json``."""
        return f"{self.check(n):0{self.digits}d}.json"

    def commit_key(self, n: int) -> str:
        """The commit object's key below the location: ``<area>/000000000007.json``."""
        return f"{self.area}/{self.commit_name(n)}"

    def stem(self, n: int) -> str:
        """The start of ``n``'s blob keys below the location, as commit objects record them: ``<area>/<n>``."""
        return f"{self.area}/{self.check(n):0{self.digits}d}"

    def blob_name(self, key: str) -> str:
        """A blob key below the location (as commit objects record it) -> its name in the area."""
        return key.removeprefix(f"{self.area}/")

    def commit(self, area: ts.ObjectArea, n: int, blobs: Sequence[tuple[str, Any]], commit: bytes,
               exists: Callable[[bool], Exception]) -> None:
        """Commit ``n`` as the store commits records: data first, then the commit object created with put-if-absent,
        so that ``n`` exists exactly when its commit object does. ``blobs`` are (key below the location, bytes-like
        or a list of parts); ``exists(concurrent)`` makes the error for an ``n`` that was committed already (checked
        before any upload, so a large blob is not uploaded for nothing: ``concurrent`` False) or by another writer
        meanwhile (True). A writer killed between the two leaves orphan blobs that no reader looks at."""
        if area.exists(self.commit_name(n)):
            raise exists(False)
        for key, data in blobs:
            area.put(self.blob_name(key), data)
        if not area.put_if_absent(self.commit_name(n), commit):
            raise exists(True)

    def numbers(self, area: ts.ObjectArea) -> list[int]:
        """The committed numbers, ascending (a fresh listing of the area)."""
        pattern = re.compile(rf"(\d{{{self.digits}}})\.json")
        return sorted(int(m.group(1)) for o in area.list() if (m := pattern.fullmatch(o.key)))


def check_number(value: Any, digits: int, what: str) -> int:
    """``value`` if it is an int in [0, 10^digits) (the number in a commit object's key); else ConfigError."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 10**digits:
        raise ConfigError(f"{what} must be an int in [0, 10^{digits}), got {value!r}")
    return value


#: the blob checksum of each format version of the commit objects
CHECKSUMS: dict[int, str] = {1: "sha256", 2: "crc32c", 3: "crc32c"}
#: the format version written, and the ones read. Format 3 wraps the object's fields in a checksummed string
#: (`encode_commit`): a flipped digit anywhere in them is an integrity error, not a different value.
WRITE_FORMAT = 3
READ_FORMATS = (1, 2, 3)
#: from this format version on, a commit object's fields are a JSON text with its own crc32c
WRAPPED_FROM = 3
_HEX = {"sha256": re.compile(r"[0-9a-f]{64}"), "crc32c": re.compile(r"[0-9a-f]{8}")}


def _parts(data: Any) -> list:
    return list(data) if isinstance(data, (list, tuple)) else [data]


def checksum(data: Any, algorithm: str) -> str:
    """Hex checksum of ``data`` (bytes-like, or a list of bytes-like parts taken in order): ``sha256`` (64 hex) or
    ``crc32c`` (8 hex). Both release the GIL."""
    if algorithm == "sha256":
        h = hashlib.sha256()
        for part in _parts(data):
            h.update(part)
        return h.hexdigest()
    crc = 0
    for part in _parts(data):
        crc = _crc32c.crc32c(part, crc)
    return f"{crc:08x}"


def blob_ref(data: Any, stem: str, suffix: str, fmt: int = WRITE_FORMAT) -> dict[str, Any]:
    """The reference to ``data`` (bytes-like or a list of parts) in a commit object of format ``fmt``: its key
    (named by its checksum, so a retry or a racing writer never overwrites other bytes), checksum and size."""
    algorithm = CHECKSUMS[fmt]
    hexsum = checksum(data, algorithm)
    return {"key": f"{stem}-{hexsum[:16]}{suffix}", algorithm: hexsum,
            "bytes": sum(memoryview(p).nbytes for p in _parts(data))}


def ref_is_valid(ref: Any, fmt: int, stem: str, suffix: str, *, keyed: bool = True) -> bool:
    """Whether ``ref`` is a well-formed blob reference of a format-``fmt`` object whose key is ``stem``/``suffix``
    (``keyed=False``: a size and checksum of a file whose name is not derived from its checksum)."""
    size = ref.get("bytes") if isinstance(ref, Mapping) else None
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        return False
    algorithm = CHECKSUMS[fmt]
    hexsum = ref.get(algorithm)
    return (isinstance(hexsum, str) and _HEX[algorithm].fullmatch(hexsum) is not None
            and (not keyed or ref.get("key") == f"{stem}-{hexsum[:16]}{suffix}"))


def blob_mismatch(data: bytes, ref: Mapping[str, Any], fmt: int) -> str | None:
    """None when ``data`` has the size and checksum ``ref`` names; else what differs (for the error message)."""
    algorithm = CHECKSUMS[fmt]
    if len(data) != ref["bytes"]:
        return f"{len(data)} bytes, the commit object says {ref['bytes']}"
    got = checksum(data, algorithm)
    if got != ref[algorithm]:
        return f"{algorithm} {got[:16]}, the commit object says {ref[algorithm][:16]}"
    return None


def encode_commit(kind: str, fmt: int, fields: Mapping[str, Any]) -> bytes:
    """The bytes of a commit object of ``kind`` and format ``fmt`` holding ``fields`` (JSON-ready): from format 3
    ``{"kind", "format_version", "fields": "<the fields as a JSON text>", "fields_crc32c": "<8 hex>"}``, the crc32c
    of the text's UTF-8 bytes (so a reader in any language checks the exact bytes before it parses them); before,
    the fields at the top level beside ``kind`` and ``format_version``.

    Raises ValueError / TypeError (json's) for fields that are not JSON-serializable."""
    if fmt < WRAPPED_FROM:
        return json.dumps({"kind": kind, "format_version": fmt, **fields}, sort_keys=True, allow_nan=False).encode()
    text = json.dumps(dict(fields), sort_keys=True, allow_nan=False)
    return json.dumps({"kind": kind, "format_version": fmt, "fields": text,
                       "fields_crc32c": checksum(text.encode(), "crc32c")}, sort_keys=True).encode()


def read_commit(area: ts.ObjectArea, name: str, kind: str, formats: Collection[int], *, missing: Exception,
                corrupt: type[Exception], version_error: type[Exception]) -> dict:
    """The JSON object ``name`` of ``area``, checked to be of ``kind`` and one of the format versions ``formats``;
    a format-3 object's fields are checked against their crc32c and returned beside ``kind`` and
    ``format_version`` (the same flat dict as formats 1 and 2).

    Raises ``missing`` when the object does not exist, ``corrupt`` when it is not a JSON object of ``kind`` or its
    fields do not match their checksum, and ``version_error`` for another format version (each message names the
    object's URL)."""
    where = area.describe(name)
    try:
        raw = area.get(name)
    except ts.ObjectNotFoundError:
        raise missing from None
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise corrupt(f"{where}: not JSON: {e}") from e
    if not isinstance(obj, dict) or obj.get("kind") != kind:
        raise corrupt(f"{where}: not a {kind} object")
    fv = obj.get("format_version")
    if isinstance(fv, bool) or fv not in formats:
        raise version_error(f"{where}: {kind} format_version {fv!r}; this code reads "
                            f"{', '.join(map(str, sorted(formats)))}")
    if fv < WRAPPED_FROM:
        return obj
    text, crc = obj.get("fields"), obj.get("fields_crc32c")
    if not isinstance(text, str) or not isinstance(crc, str):
        raise corrupt(f"{where}: a format-{fv} {kind} object needs 'fields' (a JSON text) and 'fields_crc32c'")
    got = checksum(text.encode(), "crc32c")
    if got != crc:
        raise corrupt(f"{where}: its fields have crc32c {got}, the object says {crc}: changed after it was written")
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as e:
        raise corrupt(f"{where}: its fields are not JSON: {e}") from e
    if not isinstance(fields, dict) or {"kind", "format_version"} & set(fields):
        raise corrupt(f"{where}: its fields are not a JSON object of fields")
    return {"kind": kind, "format_version": fv, **fields}
