"""Format constants and id validation (one place; ``schemas/FORMAT.md`` is the normative description)."""

from __future__ import annotations

import numbers
import re

from traceschemas import FORMAT_VERSION, SUPPORTED_FORMAT_VERSIONS

from ..errors import InvalidIdError, SchemaVersionError
from ..storage.base import PARTIAL_SUFFIX

__all__ = ["FORMAT_VERSION", "SUPPORTED_FORMAT_VERSIONS"]  # re-exported: written / readable versions
#: ``format`` field of the manifest
FORMAT_NAME = "tracestore"

MANIFEST_KEY = "tracestore.json"
LOG_PREFIX = "log/"
DATA_PREFIX = "data/"
#: log entry keys: ``log/<seq, 12 zero-padded decimal digits>.arrow`` so that lexical order is log order
LOG_DIGITS = 12
LOG_SUFFIX = ".arrow"
#: optional checkpoints: ``index/<log_end, 12 digits>.parquet`` holds all records of entries ``[0, log_end)``
INDEX_PREFIX = "index/"
INDEX_SUFFIX = ".parquet"
#: readers use a checkpoint instead of this many (or more) individual entry GETs
CHECKPOINT_MIN_ENTRIES = 64
#: the top-level names of a store's URL that the format owns (FORMAT §2); every other top-level name belongs to
#: the applications that keep objects beside the store, and maintenance never touches it
STORE_NAMES = (LOG_PREFIX[:-1], DATA_PREFIX[:-1], INDEX_PREFIX[:-1], MANIFEST_KEY)


#: schema-metadata keys of a log entry (Arrow IPC file)
ENTRY_META_KEY = b"tracestore.entry"
ENTRY_CRC_KEY = b"tracestore.crc32c"

#: ids: trajectory ids, writer ids, site names, MoE layer names
ID_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._:-]{0,199}"
_ID_RE = re.compile(ID_PATTERN)
#: site / layer names also become zarr node names (``hints.<site>``): no ':' to stay portable
NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}"
_NAME_RE = re.compile(NAME_PATTERN)

FP4_FORMATS = {"nvfp4": 16, "mxfp4": 32}
SITE_KINDS = ("activation", "weight", "kv", "other")
#: what a site's scale row holds per block (FORMAT §2.4): ``bytes``, the whole scale byte (versions 1-3: always);
#: ``lsb``, only the byte's least significant bit, 8 blocks per byte LSB-first (a *scale hint*; nvfp4 only)
SCALE_ENCODINGS = ("bytes", "lsb")
DEFAULT_SCALE_ENCODING = "bytes"
#: the format version that introduced the site key ``scale_encoding``
SCALE_ENCODING_SINCE = 4
#: what a site stores per token (FORMAT §2.5): ``bits``, a hint bit per value and a scale row per block (versions
#: 1-4: always); ``margin``, one variable-length margin-exception row per token (opaque bytes; tracerl.hints.compact)
HINT_ENCODINGS = ("bits", "margin")
DEFAULT_HINT_ENCODING = "bits"
#: the format version that introduced the site key ``hint_encoding`` (and the codec keys of margin sites)
HINT_ENCODING_SINCE = 5
#: the codec keys of a margin site (FORMAT §2.5): required on margin sites, not allowed on bits sites;
#: ``max_row_bytes`` is optional (default DEFAULT_MAX_ROW_BYTES)
MARGIN_KEYS = ("margin", "scale_margin", "value_coding", "block_coding", "scale_payload")
MARGIN_OPTIONAL_KEYS = ("max_row_bytes",)
#: what a margin row keeps of a marked block: its E4M3 byte or only the byte's LSB
SCALE_PAYLOADS = ("byte", "lsb")
#: position codings of a margin row (``rice<k>``: k in 0..30)
POSITION_CODINGS = ("all", "bitmap", "block-bitmap", "gamma", "rice<k>")
_CODING_RE = re.compile(r"all|bitmap|block-bitmap|gamma|rice([0-9]|[12][0-9]|30)")
#: positions per group of the ``block-bitmap`` coding (its row length must be a multiple of it)
CODING_GROUP = 16
#: the longest row a margin site may store, unless its ``max_row_bytes`` says less: default and largest allowed
DEFAULT_MAX_ROW_BYTES = 1 << 16
MAX_ROW_BYTES_LIMIT = 1 << 24
#: a margin site's rows of one segment are at most this many bytes (its ends are uint32)
MAX_MARGIN_SEGMENT_BYTES = (1 << 32) - 1
#: bytes per inner chunk of a ``margin.<site>`` array, per row of the segment's ``chunk_rows`` (FORMAT §2.3)
MARGIN_CHUNK_BYTES_PER_ROW = 64
#: the version of a new store whose declaration needs nothing newer (a version-3 reader reads it)
BASE_FORMAT_VERSION = 3

#: token positions, row numbers and policy versions are int64 wherever they are stored
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

DEFAULT_CHUNK_ROWS = 1024
DEFAULT_SHARD_BYTES = 16 << 20
DEFAULT_GC_GRACE_S = 3600.0


def check_version(found: object, where: str, *, supported=SUPPORTED_FORMAT_VERSIONS, writes=FORMAT_VERSION) -> None:
    """The one format-version check (manifest, log entries, checkpoints, snapshots, cursors): ``found`` must be
    one of ``supported`` (a JSON ``true`` is not the version 1).

    Raises:
        SchemaVersionError: "<where> has version <found>; this tracestore writes version <writes> and reads
        versions <supported>".
    """
    if isinstance(found, bool) or found not in supported:
        raise SchemaVersionError(f"{where} has version {found!r:.40}; this tracestore writes version {writes!r} and "
                                 f"reads versions {list(supported)}")


def is_position_coding(value: object) -> bool:
    """Whether ``value`` names a position coding of :data:`POSITION_CODINGS` (``rice<k>`` with k in 0..30)."""
    return isinstance(value, str) and _CODING_RE.fullmatch(value) is not None


def margin_chunk_bytes(chunk_rows: int) -> int:
    """Bytes per inner chunk of a segment's ``margin.<site>`` arrays: 64 per row of its ``chunk_rows``."""
    return MARGIN_CHUNK_BYTES_PER_ROW * chunk_rows


def is_int(x: object) -> bool:
    """Whether ``x`` is an integer (Python or numpy), and not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def log_key(seq: int) -> str:
    return f"{LOG_PREFIX}{seq:0{LOG_DIGITS}d}{LOG_SUFFIX}"


def checkpoint_key(log_end: int) -> str:
    return f"{INDEX_PREFIX}{log_end:0{LOG_DIGITS}d}{INDEX_SUFFIX}"


def parse_checkpoint_key(key: str) -> int | None:
    if not key.startswith(INDEX_PREFIX) or not key.endswith(INDEX_SUFFIX):
        return None
    body = key[len(INDEX_PREFIX) : -len(INDEX_SUFFIX)]
    return int(body) if len(body) == LOG_DIGITS and body.isdigit() else None


def parse_log_key(key: str) -> int | None:
    """``log/000000000042.arrow`` -> 42; anything else (``.partial`` files, strays) -> None."""
    if not key.startswith(LOG_PREFIX) or not key.endswith(LOG_SUFFIX):
        return None
    body = key[len(LOG_PREFIX) : -len(LOG_SUFFIX)]
    if len(body) != LOG_DIGITS or not body.isdigit():
        return None
    return int(body)


def is_store_key(key: str) -> bool:
    """Whether ``key`` lies in the part of the URL the store owns (FORMAT §2): below ``log/``, ``data/`` or
    ``index/``, the manifest, or the local backend's temporary file of an unfinished manifest write
    (``.tracestore.json.<uuid>.partial``, beside the manifest)."""
    top, sep, _ = key.partition("/")
    if sep:
        return top in STORE_NAMES
    return key == MANIFEST_KEY or (key.startswith(f".{MANIFEST_KEY}.") and key.endswith(PARTIAL_SUFFIX))


def _describe(value: object) -> str:
    text = repr(value)
    if len(text) <= 80:
        return text
    size = f" ({len(value)} chars)" if isinstance(value, str) else ""
    return f"{text[:60]}...{size}"


def _check(value: object, what: str, pattern: re.Pattern, allowed: str) -> str:
    if not isinstance(value, str):
        raise InvalidIdError(f"{what} must be a str, got {type(value).__name__} {_describe(value)}")
    if not pattern.fullmatch(value) or ".." in value:
        raise InvalidIdError(
            f"invalid {what} {_describe(value)}: allowed are {allowed}, starting with a letter or digit, without '..'"
        )
    return value


def check_id(value: object, what: str = "trajectory id") -> str:
    """Validate a trajectory/writer id: ``[A-Za-z0-9][A-Za-z0-9._:-]{0,199}`` and no ``..``.

    Raises:
        InvalidIdError: anything else (not a str, empty, too long, ``/``, ``..``, NUL, whitespace ...).
    """
    return _check(value, what, _ID_RE, "1-200 characters of [A-Za-z0-9._:-]")


def check_name(value: object, what: str = "site name") -> str:
    """Validate a site or MoE layer name: ``[A-Za-z0-9][A-Za-z0-9._-]{0,99}`` and no ``..``."""
    return _check(value, what, _NAME_RE, "1-100 characters of [A-Za-z0-9._-]")
