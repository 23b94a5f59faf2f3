"""Trainer checkpoints as immutable objects at a location (local directory or S3), committed atomically.

Layout, below the location URL (a directory of its own, or a prefix beside a store: tracestore's ``gc`` and
``verify`` leave ``checkpoints/`` alone)::

    checkpoints/<step, 12 digits>-<checksum>.<name>        one blob per part (model, optimizer, ...), immutable
    checkpoints/<step, 12 digits>.json                      the commit: a manifest, created with put_if_absent

Saving follows the store's commit protocol: the blobs first, each under a name that carries its hash (``put``:
a reader never sees a partial object, and a retry cannot overwrite different bytes), then the manifest with
``put_if_absent``. A checkpoint exists exactly when its manifest exists; a trainer killed while saving leaves
orphan blobs that no reader looks at, and the previous checkpoint stays the latest. A second commit of the same
step fails with `CheckpointExistsError`.

Manifest (JSON)::

    {"kind": "tracerl.checkpoint", "format_version": 2, "step": 12, "created_unix": 1.7e9,
     "blobs": {"model": {"key": "checkpoints/000000000012-<crc32c>.model", "crc32c": "<8 hex>", "bytes": 1234}, ...},
     "state": {...}}

(format 1, still read: ``sha256`` with 64 hex digits, its first 16 in the key; see `tracerl.artifacts.objects`.)

``state`` is the caller's JSON (the trainer keeps its step, policy version, store cursor, RNG states and the last
step's metrics there). `load` checks the manifest's kind and format version, then every blob's size and checksum,
before it returns anything: a corrupt or missing checkpoint raises a typed error and the caller has changed
nothing yet.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import time
from collections.abc import Mapping
from typing import Any

import tracestore as ts
from tracerl.artifacts import objects as ob
from tracerl.artifacts.objects import Location
from tracerl.errors import CheckpointCorruptError, CheckpointExistsError, CheckpointNotFoundError, ConfigError

log = logging.getLogger(__name__)

FORMAT_VERSION, READ_FORMATS = ob.WRITE_FORMAT, ob.READ_FORMATS  # written; read
KIND = "tracerl.checkpoint"  # the manifests' kind (format data, not a module path)
#: ``checkpoints/<step>.json`` (the manifest) and ``checkpoints/<step>-<checksum>.<blob name>``
STEPS = ob.NumberedObjects("checkpoints", "checkpoint step")
AREA = STEPS.area  # the store's application area of checkpoints (tracestore FORMAT §2)
PREFIX = f"{AREA}/"
STEP_DIGITS = STEPS.digits
_NAME_RE = re.compile(r"[a-z][a-z0-9_]{0,31}")

__all__ = ["Checkpoint", "save", "load", "list_steps", "latest_step", "prune", "manifest_key"]


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A loaded, verified checkpoint: its ``step``, the caller's ``state`` JSON and the blobs' bytes by name."""

    step: int
    state: dict
    blobs: dict[str, bytes]
    created_unix: float


def manifest_key(step: int) -> str:
    """``checkpoints/<step, 12 digits>.json``: the key of the checkpoint's manifest below the location."""
    return STEPS.commit_key(step)


def save(location: Location, step: int, blobs: Mapping[str, Any], state: Mapping[str, Any], *,
         storage_options: Mapping | None = None) -> str:
    """Commit checkpoint ``step`` (blobs by name: bytes-like, or lists of bytes-like parts written as their
    concatenation; ``state`` JSON); returns the manifest key.

    Raises:
        ConfigError: bad step, a blob name outside ``[a-z][a-z0-9_]*`` (32 characters at most), state not JSON.
        CheckpointExistsError: ``step`` is already committed (nothing is changed).
        tracestore.BackendError: the storage failed (nothing is committed; a retry is safe).
    """
    step = STEPS.check(step)
    for name in blobs:
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            raise ConfigError(f"checkpoint blob name {name!r}: use 1-32 characters of [a-z0-9_], starting with a letter")
    refs = {name: ob.blob_ref(data, STEPS.stem(step), f".{name}", FORMAT_VERSION)
            for name, data in blobs.items()}
    manifest = {"kind": KIND, "format_version": FORMAT_VERSION, "step": step, "created_unix": time.time(),
                "blobs": refs, "state": dict(state)}
    try:
        raw = json.dumps(manifest, sort_keys=True, allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise ConfigError(f"checkpoint {step}: state is not JSON-serializable: {e}") from e
    with ob.opened(location, AREA, storage_options) as area:
        STEPS.commit(area, step, [(refs[name]["key"], data) for name, data in blobs.items()], raw,
                     lambda concurrent: CheckpointExistsError(
                         f"{area.url}: checkpoint {step} was committed {'concurrently' if concurrent else 'already'}"))
        log.info("checkpoint %d committed to %s (%d bytes)", step, area.url, sum(r["bytes"] for r in refs.values()))
        return manifest_key(step)


def list_steps(location: Location, *, storage_options: Mapping | None = None) -> list[int]:
    """Committed checkpoint steps, ascending (a fresh listing)."""
    with ob.opened(location, AREA, storage_options) as area:
        return STEPS.numbers(area)


def latest_step(location: Location, *, storage_options: Mapping | None = None) -> int | None:
    """The highest committed step, or None when the location holds no checkpoint."""
    steps = list_steps(location, storage_options=storage_options)
    return steps[-1] if steps else None


def _manifest(area: ts.ObjectArea, step: int) -> dict:
    key = manifest_key(step)
    man = ob.read_commit(area, STEPS.commit_name(step), KIND, READ_FORMATS, corrupt=CheckpointCorruptError,
                      version_error=CheckpointCorruptError,
                      missing=CheckpointNotFoundError(f"{area.url}: no checkpoint {step} ({key} does not exist)"))
    blobs = man.get("blobs")
    if (man.get("step") != step or not isinstance(man.get("state"), dict) or not isinstance(blobs, dict)
            or not all(ob.ref_is_valid(r, man["format_version"], STEPS.stem(step), f".{n}")
                       for n, r in blobs.items())):
        raise CheckpointCorruptError(f"{area.describe(STEPS.commit_name(step))}: manifest fields do not describe "
                                     f"checkpoint {step}")
    return man


def load(location: Location, step: int | None = None, *, storage_options: Mapping | None = None) -> Checkpoint:
    """The verified checkpoint ``step`` (None: the latest).

    Raises:
        CheckpointNotFoundError: no checkpoint at all (for None), or none of that step.
        CheckpointCorruptError: a manifest that does not decode or describe the step, another kind or format
            version, a blob missing or of the wrong size or checksum.
        tracestore.BackendError: the storage failed.
    """
    with ob.opened(location, AREA, storage_options) as area:
        if step is None:
            step = latest_step(area)
            if step is None:
                raise CheckpointNotFoundError(f"{area.url}: holds no checkpoint ({PREFIX}*.json)")
        man = _manifest(area, STEPS.check(step))
        blobs = {}
        for name, ref in man["blobs"].items():
            try:
                data = area.get(STEPS.blob_name(ref["key"]))
            except ts.ObjectNotFoundError:
                raise CheckpointCorruptError(f"{area.url}: checkpoint {step} is committed but its blob "
                                             f"{ref['key']} is missing") from None
            bad = ob.blob_mismatch(data, ref, man["format_version"])
            if bad is not None:
                raise CheckpointCorruptError(f"{area.describe(STEPS.blob_name(ref['key']))}: {bad}")
            blobs[name] = data
        return Checkpoint(step, man["state"], blobs, float(man.get("created_unix", 0.0)))


def prune(location: Location, keep_last: int, *, keep: tuple[int, ...] = (),
          storage_options: Mapping | None = None) -> list[int]:
    """Delete all but the ``keep_last`` newest checkpoints (and those in ``keep``); returns the deleted steps.

    The manifest goes first, so a reader sees a checkpoint whole or not at all; blobs of a deleted manifest are
    orphans from then on and are deleted after it."""
    if keep_last < 1:
        raise ConfigError(f"keep_last={keep_last}: keep at least the newest checkpoint")
    with ob.opened(location, AREA, storage_options) as area:
        steps = list_steps(area)
        doomed = [s for s in steps[:-keep_last] if s not in keep]
        for s in doomed:
            man = _manifest(area, s)
            area.delete(STEPS.commit_name(s))
            area.delete_many(STEPS.blob_name(r["key"]) for r in man["blobs"].values())
        return doomed
