"""Reading and writing tracerl's commit objects (policy-version sidecars, checkpoint manifests) as bytes, for tests
that damage them: format 3 wraps the fields in a checksummed JSON text (schemas/ARTIFACTS.md), formats 1 and 2 keep
them at the top level."""

from __future__ import annotations

import json

import crc32c


def fields(raw: bytes) -> dict:
    """The fields of a commit object (format 3: the checksummed text parsed; before: the object itself)."""
    obj = json.loads(raw)
    return json.loads(obj["fields"]) if obj.get("format_version", 0) >= 3 else obj


def wrap(kind: str, fields: dict, *, format_version: int = 3, crc: str | None = None) -> bytes:
    """A format-3 commit object of ``fields`` (with their true crc32c unless ``crc`` is given)."""
    text = json.dumps(fields, sort_keys=True)
    return json.dumps({"kind": kind, "format_version": format_version, "fields": text,
                       "fields_crc32c": crc if crc is not None else f"{crc32c.crc32c(text.encode()):08x}"}).encode()
