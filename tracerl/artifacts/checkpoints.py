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

    {"kind": "tracerl.checkpoint", "format_version": 3, "step": 12, "created_unix": 1.7e9,
     "blobs": {"name": {"key": "checkpoints/000000000012-<crc32c>.name", "crc32c": "<8 hex>", "bytes": 1234}, ...},
     "tensors": {"dir": "checkpoints/000000000012-<token>.dcp", "world_size": 2,
                 "files": {".metadata": {"crc32c": "<8 hex>", "bytes": 5678}, "__0_0.distcp": {...}, ...}},
     "state": {...}}

``tensors`` (format 3, optional) is a `torch.distributed.checkpoint` directory written by every rank of a trainer
(`save_sharded`): the ranks' shards and its ``.metadata``, each file's size and crc32c in the manifest, which is
created after all of them (so the commit protocol holds for it as for blobs); `load_tensors` checks every file
(the ranks share the reading) and lets the distributed checkpoint reshard them to the loading world size. The
directory name carries a random token: a save killed half-way leaves an orphan directory nobody reads, and a retry
writes a new one. (Formats 1 and 2, still read, have blobs only; format 1 used ``sha256`` with 64 hex digits, its
first 16 in the key; see `tracerl.artifacts.objects`.)

``state`` is the caller's JSON (the trainer keeps its step, policy version, store cursor, RNG states and the last
step's metrics there). `load` checks the manifest's kind and format version, then every blob's size and checksum,
before it returns anything: a corrupt or missing checkpoint raises a typed error and the caller has changed
nothing yet.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import time
import uuid
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import tracestore as ts
from tracerl.artifacts import objects as ob
from tracerl.artifacts.objects import Location
from tracerl.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigError,
)

log = logging.getLogger(__name__)

FORMAT_VERSION, READ_FORMATS = ob.WRITE_FORMAT, ob.READ_FORMATS  # written (3: blobs and/or the tensors of a
# distributed checkpoint, fields checksummed); read (1, 2: blobs only)
KIND = "tracerl.checkpoint"  # the manifests' kind (format data, not a module path)
#: ``checkpoints/<step>.json`` (the manifest) and ``checkpoints/<step>-<checksum>.<blob name>``
STEPS = ob.NumberedObjects("checkpoints", "checkpoint step")
AREA = STEPS.area  # the store's application area of checkpoints (tracestore FORMAT §2)
PREFIX = f"{AREA}/"
STEP_DIGITS = STEPS.digits
_NAME_RE = re.compile(r"[a-z][a-z0-9_]{0,31}")
#: a distributed checkpoint's directory (below the location) and the names of the files torch writes into it
_DIR_RE = re.compile(r"checkpoints/\d{12}-[0-9a-f]{12}\.dcp")
_FILE_RE = re.compile(r"\.metadata|__\d+_\d+\.distcp")

__all__ = ["Checkpoint", "save", "save_sharded", "load", "load_tensors", "list_steps", "latest_step", "prune",
           "manifest_key"]


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A loaded, verified checkpoint: its ``step``, the caller's ``state`` JSON and the blobs' bytes by name."""

    step: int
    state: dict
    blobs: dict[str, bytes]
    created_unix: float
    #: format 3 with tensors: the distributed checkpoint's directory (a key below the location), its world size and
    #: files ``{name: {"crc32c", "bytes"}}`` (load them with `load_tensors`); None otherwise
    tensors: dict | None = None
    #: where it was loaded from (its tensors are read from there), and the storage options used
    location: Any = dataclasses.field(default=None, repr=False, compare=False)
    storage_options: Mapping | None = dataclasses.field(default=None, repr=False, compare=False)


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
    refs, raw = _manifest_bytes(step, blobs, state, None)
    with ob.opened(location, AREA, storage_options) as area:
        STEPS.commit(area, step, [(refs[name]["key"], data) for name, data in blobs.items()], raw,
                     _exists_error(area, step))
        log.info("checkpoint %d committed to %s (%d bytes)", step, area.url, sum(r["bytes"] for r in refs.values()))
        return manifest_key(step)


def _manifest_bytes(step: int, blobs: Mapping[str, Any], state: Mapping[str, Any],
                    tensors: Mapping[str, Any] | None) -> tuple[dict, bytes]:
    """(blob references, the manifest's JSON bytes); raises ConfigError for state that is not JSON."""
    refs = {name: ob.blob_ref(data, STEPS.stem(step), f".{name}", FORMAT_VERSION) for name, data in blobs.items()}
    fields = {"step": step, "created_unix": time.time(), "blobs": refs, "state": dict(state)}
    if tensors is not None:
        fields["tensors"] = dict(tensors)
    try:
        return refs, ob.encode_commit(KIND, FORMAT_VERSION, fields)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"checkpoint {step}: state is not JSON-serializable: {e}") from e


def _exists_error(area: ts.ObjectArea, step: int):
    return lambda concurrent: CheckpointExistsError(
        f"{area.url}: checkpoint {step} was committed {'concurrently' if concurrent else 'already'}")


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
                       for n, r in blobs.items()) or not _tensors_valid(man.get("tensors"), step)):
        raise CheckpointCorruptError(f"{area.describe(STEPS.commit_name(step))}: manifest fields do not describe "
                                     f"checkpoint {step}")
    return man


def _tensors_valid(tensors: Any, step: int) -> bool:
    """Whether a manifest's ``tensors`` entry is absent or well-formed for ``step``."""
    if tensors is None:
        return True
    if not isinstance(tensors, Mapping) or not isinstance(tensors.get("files"), Mapping) or not tensors["files"]:
        return False
    d = tensors.get("dir")
    if not (isinstance(d, str) and _DIR_RE.fullmatch(d) and d.startswith(STEPS.stem(step) + "-")):
        return False
    w = tensors.get("world_size")
    return (isinstance(w, int) and not isinstance(w, bool) and w >= 1 and ".metadata" in tensors["files"]
            and all(isinstance(n, str) and _FILE_RE.fullmatch(n) and ob.ref_is_valid(r, 3, "", "", keyed=False)
                    for n, r in tensors["files"].items()))


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
        return Checkpoint(step, man["state"], blobs, float(man.get("created_unix", 0.0)), man.get("tensors"),
                          location, storage_options)


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
            if man.get("tensors"):
                d = STEPS.blob_name(man["tensors"]["dir"])
                area.delete_many(o.key for o in area.list(d + "/"))
        return doomed


# ---------------------------------------------------------------------------------------------- sharded tensors
def _dist():
    """(rank, world size, whether a process group is up)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), True
    return 0, 1, False


@contextlib.contextmanager
def _single_process(up: bool) -> Iterator[None]:
    """Without a process group, silence torch's warning that it assumes one process (that is what is meant)."""
    with warnings.catch_warnings():
        if not up:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _from_rank0(value: Any, up: bool) -> Any:
    """``value`` as rank 0 has it, on every rank (a broadcast under torch.distributed)."""
    if not up:
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather(value: Any, up: bool, world: int) -> list[Any]:
    if not up:
        return [value]
    import torch.distributed as dist

    out: list[Any] = [None] * world
    dist.all_gather_object(out, value)
    return out


def _raise_first(errors: list[str | None], what: type[Exception]) -> None:
    """Every rank raises the first rank's error when any rank had one (no rank is left waiting in a collective)."""
    bad = [e for e in errors if e]
    if bad:
        raise what(bad[0])


def _dcp_storage(area: ts.ObjectArea, dirname: str, storage_options: Mapping | None, *, write: bool):
    """A torch.distributed.checkpoint writer or reader of the directory ``dirname`` (a key below the location)."""
    import torch.distributed.checkpoint as dcp

    url = area.url.removeprefix("file://").rstrip("/") + "/" + dirname
    if "://" not in url:
        return dcp.FileSystemWriter(url, sync_files=True) if write else dcp.FileSystemReader(url)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    opts = dict(storage_options or {})
    return FsspecWriter(url, sync_files=True, **opts) if write else FsspecReader(url, **opts)


def save_sharded(location: Location, step: int, tensors: Mapping[str, Any], state: Mapping[str, Any], *,
                 storage_options: Mapping | None = None) -> str:
    """Commit checkpoint ``step`` whose tensors (a nested dict of tensors and DTensors: each rank passes its own
    shards) are written by `torch.distributed.checkpoint` into a fresh directory, with the caller's ``state`` JSON
    (rank 0's) in the manifest. Every rank of the process group calls it (it is a collective), or one process without
    one. Returns the manifest key.

    Order: the directory (every rank its shards, then the coordinator the ``.metadata``), then each file read back
    and checksummed (the ranks share the files), then the manifest created with put-if-absent by rank 0.

    Raises (on every rank):
        CheckpointExistsError: ``step`` is committed already (nothing is written) or was meanwhile.
        ConfigError: bad step or state that is not JSON. tracestore.BackendError: the storage failed.
    """
    import crc32c
    import torch.distributed.checkpoint as dcp

    rank, world, up = _dist()
    step = STEPS.check(step)
    with ob.opened(location, AREA, storage_options) as area:
        committed = _from_rank0(area.exists(STEPS.commit_name(step)) if rank == 0 else None, up)
        if committed:
            raise _exists_error(area, step)(False)
        dirname = f"{STEPS.stem(step)}-{_from_rank0(uuid.uuid4().hex[:12] if rank == 0 else None, up)}.dcp"
        with _single_process(up):
            dcp.save(dict(tensors), storage_writer=_dcp_storage(area, dirname, storage_options, write=True),
                     no_dist=not up)
        names = sorted(o.key.removeprefix(STEPS.blob_name(dirname) + "/")
                       for o in area.list(STEPS.blob_name(dirname) + "/"))
        mine = {}
        for name in names[rank::world]:
            data = area.get(f"{STEPS.blob_name(dirname)}/{name}")
            mine[name] = {"crc32c": f"{crc32c.crc32c(data):08x}", "bytes": len(data)}
        files = {k: v for part in _gather(mine, up, world) for k, v in part.items()}
        error = None
        if rank == 0:
            try:
                _, raw = _manifest_bytes(step, {}, state, {"dir": dirname, "world_size": world, "files": files})
                STEPS.commit(area, step, [], raw, _exists_error(area, step))
                log.info("checkpoint %d committed to %s (%d files, %d bytes, world size %d)", step, area.url,
                         len(files), sum(f["bytes"] for f in files.values()), world)
            except (CheckpointExistsError, ConfigError, ts.TraceStoreError) as e:
                error = (type(e).__name__, str(e))
        error = _from_rank0(error, up)
        if error is not None:
            kind = {"CheckpointExistsError": CheckpointExistsError, "ConfigError": ConfigError}.get(error[0],
                                                                                                      CheckpointError)
            raise kind(error[1])
        return manifest_key(step)


def load_tensors(checkpoint: Checkpoint, template: Mapping[str, Any]) -> None:
    """Fill ``template`` (a nested dict of tensors and DTensors of the checkpoint's structure: each rank its own
    shards, at any world size) with ``checkpoint``'s tensors (read from where `load` found it), in place, after
    checking every file of its
    directory against the manifest (size and crc32c; the ranks share the files). Every rank calls it.

    Raises (on every rank) `CheckpointCorruptError` for a checkpoint without tensors, a missing, truncated or
    changed file, or tensors that do not fit the template; tracestore.BackendError when the storage fails."""
    import crc32c
    import torch.distributed.checkpoint as dcp

    rank, world, up = _dist()
    if not checkpoint.tensors:
        raise CheckpointCorruptError(f"checkpoint {checkpoint.step} holds no distributed-checkpoint tensors "
                                     "(format 1 or 2: blobs only)")
    dirname, files = checkpoint.tensors["dir"], checkpoint.tensors["files"]
    storage_options = checkpoint.storage_options
    with ob.opened(checkpoint.location, AREA, storage_options) as area:
        error = None
        for name in sorted(files)[rank::world]:
            key = f"{STEPS.blob_name(dirname)}/{name}"
            try:
                data = area.get(key)
            except ts.ObjectNotFoundError:
                error = f"{area.url}: checkpoint {checkpoint.step} is committed but its file {dirname}/{name} is missing"
                break
            got = {"crc32c": f"{crc32c.crc32c(data):08x}", "bytes": len(data)}
            if got != {k: files[name][k] for k in ("crc32c", "bytes")}:
                error = (f"{area.describe(key)}: {got['bytes']} bytes, crc32c {got['crc32c']}; the manifest says "
                         f"{files[name]['bytes']} bytes, crc32c {files[name]['crc32c']}")
                break
        _raise_first(_gather(error, up, world), CheckpointCorruptError)
        try:
            with _single_process(up):
                dcp.load(dict(template), storage_reader=_dcp_storage(area, dirname, storage_options, write=False),
                         no_dist=not up)
            error = None
        except (dcp.CheckpointException, RuntimeError, ValueError, KeyError) as e:
            error = f"checkpoint {checkpoint.step}: its tensors do not load into this trainer: {str(e)[:400]}"
        _raise_first(_gather(error, up, world), CheckpointCorruptError)
