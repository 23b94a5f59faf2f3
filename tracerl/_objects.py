"""Immutable JSON commit objects (a policy version's sidecar, a checkpoint's manifest): the one reader both use."""

from __future__ import annotations

import json
from typing import Any

import tracestore as ts
from tracerl.errors import ConfigError


def check_number(value: Any, digits: int, what: str) -> int:
    """``value`` if it is an int in [0, 10^digits) (the number in a commit object's key); else ConfigError."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 10**digits:
        raise ConfigError(f"{what} must be an int in [0, 10^{digits}), got {value!r}")
    return value


def read_commit(backend: ts.Backend, key: str, kind: str, format_version: int, *, missing: Exception,
                corrupt: type[Exception], version_error: type[Exception]) -> dict:
    """The JSON object at ``key``, checked to be of ``kind`` and ``format_version``.

    Raises ``missing`` when the object does not exist, ``corrupt`` when it is not a JSON object of ``kind``, and
    ``version_error`` for another format version (each message names the URL and the key)."""
    try:
        raw = backend.get(key)
    except ts.ObjectNotFoundError:
        raise missing from None
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise corrupt(f"{backend.url}/{key}: not JSON: {e}") from e
    if not isinstance(obj, dict) or obj.get("kind") != kind:
        raise corrupt(f"{backend.url}/{key}: not a {kind} object")
    if obj.get("format_version") != format_version:
        raise version_error(f"{backend.url}/{key}: {kind} format_version {obj.get('format_version')!r}; this code "
                            f"reads {format_version}")
    return obj
