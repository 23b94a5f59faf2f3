"""Snapshots and stream cursors: the small, serializable reader positions (FORMAT §5), built and parsed here only.

* snapshot: JSON ``{"kind": "tracestore.snapshot", "version": 1, "store_id", "log_end"}`` pins log entries
  ``[0, log_end)``;
* cursor: ``v1:<store_id>:<seq>:<index>`` names the next record a stream delivers (record ``index`` of entry
  ``seq``); ``<seq>`` and ``<index>`` are ASCII decimal digits.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from ..errors import SnapshotError
from .keys import check_version

__all__ = ["Snapshot", "CURSOR_VERSION", "SNAPSHOT_VERSION", "encode_cursor", "parse_cursor"]

SNAPSHOT_KIND = "tracestore.snapshot"
SNAPSHOT_VERSION = 1
CURSOR_VERSION = "v1"
_DIGITS = re.compile(r"[0-9]{1,19}")


def encode_cursor(store_id: str, seq: int, index: int) -> str:
    """``v1:<store_id>:<seq>:<index>``."""
    return f"{CURSOR_VERSION}:{store_id}:{seq}:{index}"


def parse_cursor(cursor: object, store_id: str, url: str) -> tuple[int, int]:
    """``(seq, index)`` of a cursor of the store ``store_id`` (at ``url``, named in errors).

    Raises:
        SnapshotError: not a str, malformed, numbers that are not plain ASCII digits, another store's cursor.
        SchemaVersionError: an unknown cursor version.
    """
    if not isinstance(cursor, str):
        raise SnapshotError(f"cursor must be a str, got {type(cursor).__name__}")
    parts = cursor.split(":")
    if len(parts) != 4:
        raise SnapshotError(f"malformed cursor {cursor!r:.80} (expected {CURSOR_VERSION}:<store_id>:<seq>:<index>)")
    check_version(parts[0], f"cursor {cursor!r:.80}", supported=(CURSOR_VERSION,), writes=CURSOR_VERSION)
    if parts[1] != store_id:
        raise SnapshotError(f"cursor belongs to store {parts[1]}, not {store_id} ({url})")
    # plain ASCII digits only (int() would also take " 1", "0_1", "+1" and other scripts' digits)
    if not all(_DIGITS.fullmatch(x) for x in parts[2:]):
        raise SnapshotError(f"malformed cursor {cursor!r:.80}: <seq> and <index> must be decimal digits 0-9")
    return int(parts[2]), int(parts[3])


@dataclass(frozen=True)
class Snapshot:
    """A pinned log position: the first ``log_end`` log entries (``log/0 .. log/log_end-1``) of store ``store_id``."""

    store_id: str
    log_end: int

    def to_json(self) -> str:
        return json.dumps({"kind": SNAPSHOT_KIND, "version": SNAPSHOT_VERSION, "store_id": self.store_id,
                           "log_end": self.log_end}, separators=(",", ":"))

    def to_cursor(self) -> str:
        """A stream cursor at this snapshot's end: ``store.stream(snap.to_cursor())`` tails what came after it."""
        return encode_cursor(self.store_id, self.log_end, 0)

    @classmethod
    def from_json(cls, text: str) -> Snapshot:
        """Raises SnapshotError (malformed) or SchemaVersionError (unknown snapshot version)."""
        try:
            d = json.loads(text)
        except (TypeError, ValueError) as e:
            raise SnapshotError(f"snapshot is not JSON: {text!r:.80}") from e
        if not isinstance(d, dict) or d.get("kind") != SNAPSHOT_KIND:
            raise SnapshotError(f"not a tracestore snapshot: {text!r:.80}")
        check_version(d.get("version"), "snapshot", supported=(SNAPSHOT_VERSION,), writes=SNAPSHOT_VERSION)
        store_id, log_end = d.get("store_id"), d.get("log_end")
        if not isinstance(store_id, str) or isinstance(log_end, bool) or not isinstance(log_end, int) or log_end < 0:
            raise SnapshotError(f"malformed snapshot {text!r:.80}")
        return cls(store_id, log_end)
