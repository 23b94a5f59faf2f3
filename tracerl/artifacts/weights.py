"""Policy versions as safetensors objects beside a trace store (local directory or S3), published by the trainer
and loaded by the rollout engine between generations.

Layout, below the URL (usually the store's own URL; tracestore's ``gc`` and ``verify`` leave ``weights/`` alone)::

    weights/<version, 12 digits>-<checksum>.safetensors      the tensors (immutable)
    weights/<version, 12 digits>.json                         the commit: sidecar JSON, created with put_if_absent

Publishing mirrors the store's commit protocol: data first, then an immutable commit object. The tensors are
written under a name that carries their hash (``put``: atomic, a reader never sees a partial object; the name
is unique to the content, so a retry or a racing publisher of the same version cannot overwrite another's
bytes). Then the sidecar is created with ``put_if_absent``: a version exists exactly when its sidecar exists,
and only one publisher can create it (a second gets `VersionExistsError`). A publisher killed between the two
leaves an orphan ``.safetensors`` that no reader looks at.

Sidecar (JSON)::

    {"kind": "tracerl.weights", "format_version": 2, "version": 7, "key": "weights/000000000007-<crc32c>.safetensors",
     "crc32c": "<8 hex>", "bytes": 1234, "created_unix": 1.7e9, "step": 70, "parent_version": 6,
     "tensors": 123, "meta": {...}}

(format 1, still read: ``sha256`` with 64 hex digits, its first 16 in the key; see `tracerl.artifacts.objects`.)

``step`` and ``parent_version`` are optional (null); ``meta`` is the caller's JSON-ready dict. The safetensors
header metadata carries ``tracerl.version`` too (a blob copied elsewhere still says what it is); the hash lives
only in the sidecar, since it covers the whole blob.
A reader checks the sidecar's ``kind`` and ``format_version`` first, then the blob's size and checksum, and raises
`WeightsIntegrityError` on any mismatch, never loading a tensor from unverified bytes.

Versions are integers >= 0; they need not be consecutive. ``latest_version`` lists ``weights/`` afresh (the
backends bypass listing caches), so a rollout engine that polls it sees a new version as soon as it is committed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import torch

import tracestore as ts
from tracerl.artifacts import objects as ob
from tracerl.artifacts import tensorfile as st
from tracerl.artifacts.errors import VersionExistsError, VersionNotFoundError, WeightsError, WeightsIntegrityError
from tracerl.artifacts.objects import Location
from tracerl.errors import ConfigError

log = logging.getLogger(__name__)

FORMAT_VERSION, READ_FORMATS = ob.WRITE_FORMAT, ob.READ_FORMATS  # written; read
KIND = "tracerl.weights"  # the sidecars' kind (format data, not a module path)
#: ``weights/<version>.json`` (the sidecar) and ``weights/<version>-<checksum>.safetensors``
VERSIONS = ob.NumberedObjects("weights", "policy version")
AREA = VERSIONS.area  # the store's application area of policy versions (tracestore FORMAT §2)
WEIGHTS_PREFIX = f"{AREA}/"
VERSION_DIGITS = VERSIONS.digits

__all__ = ["publish", "latest_version", "list_versions", "read_meta", "load_state_dict", "load", "load_into",
           "load_if_newer", "prune", "sidecar_key",
           "WeightsError", "WeightsIntegrityError", "VersionNotFoundError", "VersionExistsError"]


def sidecar_key(version: int) -> str:
    """``weights/<version, 12 digits>.json``: the key of the version's sidecar below the URL."""
    return VERSIONS.commit_key(version)


def _encode(state_dict: Mapping[str, torch.Tensor], version: int) -> list:
    """The safetensors file as parts (`tracerl.artifacts.tensorfile.encode`: no copy, and the GIL stays free)."""
    tensors = {}
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise ConfigError(f"state_dict[{name!r}] is a {type(t).__name__}; only tensors can be published")
        tensors[name] = t.detach().to("cpu").contiguous()
    try:
        return st.encode(tensors, metadata={"tracerl.version": str(version)})
    except ValueError as e:  # tensors that share memory (tied weights), an unsupported dtype
        raise ConfigError(f"cannot serialize the state dict as safetensors: {e}") from e


def publish(url: Location, version: int, state_dict: Mapping[str, torch.Tensor], meta: Mapping[str, Any] | None = None,
            *, step: int | None = None, parent_version: int | None = None,
            storage_options: Mapping | None = None) -> str:
    """Publish ``state_dict`` as policy ``version``; returns the sidecar key (``weights/<version>.json``).

    Args:
        url: store URL (local path, ``memory://``, ``s3://...``), an open `tracestore.Store`, or its open
            ``weights`` `tracestore.ObjectArea`.
        version: int >= 0, not yet published.
        state_dict: name -> tensor (any device and dtype; written as they are, moved to the host).
        meta: JSON-ready dict kept in the sidecar (e.g. the trainer's store cursor, the QAT mode).
        step, parent_version: optional lineage recorded in the sidecar.

    Raises:
        ConfigError: bad version, non-tensor values, tensors sharing storage, ``meta`` not JSON-serializable.
        VersionExistsError: ``version`` is already committed (by anyone, with any content).
        tracestore.BackendError: the storage failed (nothing is committed then; a retry is safe).
    """
    version = VERSIONS.check(version)
    if parent_version is not None:
        VERSIONS.check(parent_version)
    blob = _encode(state_dict, version)
    ref = ob.blob_ref(blob, VERSIONS.stem(version), ".safetensors", FORMAT_VERSION)
    key = ref["key"]
    fields = {"version": version, **ref, "created_unix": time.time(), "step": step, "parent_version": parent_version,
              "tensors": len(state_dict), "meta": dict(meta or {})}
    try:
        side_bytes = ob.encode_commit(KIND, FORMAT_VERSION, fields)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"meta of version {version} is not JSON-serializable: {e}") from e
    with ob.opened(url, AREA, storage_options) as area:
        VERSIONS.commit(area, version, [(key, blob)], side_bytes, lambda concurrent: VersionExistsError(
            f"{area.url}: policy version {version} "
            + ("was published concurrently by another publisher" if concurrent else "is already published")))
        log.info("published policy version %d to %s (%d bytes, %s)", version, area.url, ref["bytes"], key)
        return sidecar_key(version)


def list_versions(url: Location, *, storage_options: Mapping | None = None) -> list[int]:
    """Committed versions, ascending (a fresh listing of ``weights/``)."""
    with ob.opened(url, AREA, storage_options) as area:
        return VERSIONS.numbers(area)


def latest_version(url: Location, *, storage_options: Mapping | None = None) -> int | None:
    """The highest committed version, or None if nothing was published."""
    versions = list_versions(url, storage_options=storage_options)
    return versions[-1] if versions else None


def _read_sidecar(area: ts.ObjectArea, version: int) -> dict:
    key = sidecar_key(version)
    side = ob.read_commit(area, VERSIONS.commit_name(version), KIND, READ_FORMATS, corrupt=WeightsIntegrityError,
                       version_error=ts.SchemaVersionError,
                       missing=VersionNotFoundError(f"{area.url}: no policy version {version} ({key} does not exist)"))
    if side.get("version") != version or not ob.ref_is_valid(side, side["format_version"], VERSIONS.stem(version), ".safetensors"):
        raise WeightsIntegrityError(f"{area.describe(VERSIONS.commit_name(version))}: sidecar fields do not describe version {version} "
                                    f"(version {side.get('version')!r}, key {side.get('key')!r})")
    return side


def read_meta(url: Location, version: int | None = None, *, storage_options: Mapping | None = None) -> dict:
    """The sidecar of ``version`` (None: the latest) as a dict (see the module docstring); reads no tensors.

    Raises:
        VersionNotFoundError: not committed (or nothing published, for None).
        WeightsIntegrityError / tracestore.SchemaVersionError: the sidecar is corrupt or of another format.
    """
    with ob.opened(url, AREA, storage_options) as area:
        return _read_sidecar(area, _resolve(area, version))


def _resolve(area: ts.ObjectArea, version: int | None) -> int:
    if version is not None:
        return VERSIONS.check(version)
    latest = latest_version(area)
    if latest is None:
        raise VersionNotFoundError(f"{area.url}: no policy version has been published")
    return latest


def load_state_dict(url: Location, version: int | None = None, *, device: str | torch.device = "cpu",
                    storage_options: Mapping | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """(state dict on ``device``, sidecar) of ``version`` (None: the latest), after checking size and checksum.

    The blob is read once, straight into one host buffer (`tracestore.ObjectArea.read_into`), and the CPU tensors
    are views of it (`tracerl.artifacts.tensorfile.decode_views`): writable, sharing that one buffer.

    Raises:
        VersionNotFoundError: not committed (or nothing published, for None).
        WeightsIntegrityError: sidecar corrupt; blob missing, of the wrong size or hash, or not safetensors.
        WeightsError: the host cannot allocate the blob's size.
        tracestore.SchemaVersionError: a sidecar of a format version this code does not read.
        tracestore.BackendError: the storage failed.
    """
    with ob.opened(url, AREA, storage_options) as area:
        version = _resolve(area, version)
        side = _read_sidecar(area, version)
        where = area.describe(VERSIONS.blob_name(side["key"]))
        # One buffer, read straight into (local files: preadv on several threads), one byte longer than the commit
        # says (a longer object is caught); the tensors are views of it (no second copy of the weights).
        try:  # (not NumPy's: it asks for huge pages, whose first fault-in stalled a 1 GiB read for ~5 s here)
            buf = torch.empty(int(side["bytes"]) + 1, dtype=torch.uint8)
        except (RuntimeError, MemoryError) as e:
            raise WeightsError(f"{where}: cannot hold the {side['bytes']} bytes its commit names in host memory "
                               f"({e})") from None
        try:
            got = area.read_into(VERSIONS.blob_name(side["key"]), memoryview(buf.numpy()))
        except ts.ObjectNotFoundError:
            raise WeightsIntegrityError(f"{area.url}: version {version} is committed but its tensors "
                                        f"{side['key']} are missing") from None
    blob = buf[:got]
    if got > side["bytes"]:
        raise WeightsIntegrityError(f"{where}: more than {side['bytes']} bytes, the commit object says "
                                    f"{side['bytes']}")
    bad = ob.blob_mismatch(memoryview(blob.numpy()), side, side["format_version"])
    if bad is not None:
        raise WeightsIntegrityError(f"{where}: {bad}")
    try:
        tensors, _ = st.decode_views(blob)
    except st.SafetensorsFormatError as e:  # unreachable unless the hash was of bad bytes to begin with
        raise WeightsIntegrityError(f"{where}: not a safetensors file: {e}") from e
    if device != "cpu":
        tensors = {k: v.to(device) for k, v in tensors.items()}
    return tensors, side


def load(url: Location, version: int | None, model: torch.nn.Module, *,
         storage_options: Mapping | None = None) -> dict:
    """Load ``version`` (None: the latest) into ``model`` in place; returns its sidecar.

    Every parameter and buffer of the model's state dict must be present and no other name (strict); values
    are copied into the existing tensors (their device and dtype are kept).

    Raises:
        ConfigError: the published names or shapes differ from the model's (nothing is loaded then).
        and what `load_state_dict` raises.
    """
    tensors, side = load_state_dict(url, version, storage_options=storage_options)
    return load_into(model, tensors, side)


def load_into(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor], side: dict) -> dict:
    """Copy a loaded version (`load_state_dict`'s result) into ``model`` (strict names and shapes; values are
    copied into the existing tensors, keeping their device and dtype); returns ``side``.

    Raises ConfigError (nothing is loaded) when the names or shapes differ from the model's."""
    own = model.state_dict()
    missing, unexpected = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
    shapes = [k for k in own if k in tensors and tuple(own[k].shape) != tuple(tensors[k].shape)]
    if missing or unexpected or shapes:
        raise ConfigError(f"version {side['version']} does not fit the model: missing {missing[:4]}, unexpected "
                          f"{unexpected[:4]}, shape mismatches {shapes[:4]}")
    model.load_state_dict(tensors, strict=True)
    return side


def load_if_newer(url: Location, model: torch.nn.Module, current: int | None, *,
                  storage_options: Mapping | None = None) -> dict | None:
    """The rollout side's poll: if a version newer than ``current`` (None: any) is committed, load the latest
    into ``model`` and return its sidecar; else None. Raises what `load` raises."""
    with ob.opened(url, AREA, storage_options) as area:
        latest = latest_version(area)
        if latest is None or (current is not None and latest <= current):
            return None
        return load(area, latest, model)


def prune(url: Location, keep_last: int, *, keep: tuple[int, ...] = (), storage_options: Mapping | None = None) -> list[int]:
    """Delete all but the ``keep_last`` newest versions (and those in ``keep``); returns the deleted versions.

    The sidecar goes first: from then on the version is not committed (`latest_version` and readers skip it) and
    its blob is an orphan, deleted next. A reader that read the sidecar just before gets `WeightsIntegrityError`
    (blob missing) and should look for the latest version again; keeping at least 2 leaves it the newest one.

    Raises ConfigError for ``keep_last`` < 1."""
    if keep_last < 1:
        raise ConfigError(f"keep_last={keep_last}: keep at least the newest version")
    with ob.opened(url, AREA, storage_options) as area:
        doomed = [v for v in list_versions(area)[:-keep_last] if v not in keep]
        for v in doomed:
            side = _read_sidecar(area, v)
            area.delete(VERSIONS.commit_name(v))
            area.delete(VERSIONS.blob_name(side["key"]))
        return doomed
