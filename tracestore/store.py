"""Stores: create/open by URL, the declared site table and model metadata, the log head, snapshots.

See ``schemas/FORMAT.md`` for the layout. A :class:`Store` is cheap; it holds the backend and the manifest and
hands out writers, readers and streams.
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from ._format import (
    CHECKPOINT_MIN_ENTRIES,
    INDEX_PREFIX,
    LOG_PREFIX,
    parse_log_key,
    checkpoint_key,
    parse_checkpoint_key,
    DEFAULT_CHUNK_ROWS,
    DEFAULT_GC_GRACE_S,
    DEFAULT_SHARD_BYTES,
    FORMAT_NAME,
    FORMAT_VERSION,
    FP4_FORMATS,
    MANIFEST_KEY,
    SITE_KINDS,
    SUPPORTED_FORMAT_VERSIONS,
    check_name,
    log_key,
)
from ._log import LogEntry, decode_checkpoint, decode_entry, encode_checkpoint
from ._segment import ArraySpec
from .backend import Backend, RetryPolicy, open_backend
from .errors import (
    DeclarationError,
    IntegrityError,
    ObjectNotFoundError,
    SchemaVersionError,
    ShapeError,
    SnapshotError,
    StoreExistsError,
    StoreNotFoundError,
    TraceStoreError,
)

__all__ = ["Site", "Store", "Snapshot", "create_store", "open_store"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Site:
    """A quantization site: ``width`` FP4 values per token, in blocks of ``block_size`` sharing one scale byte.

    Per token the store keeps ``hint_bytes = width // 8`` hint bytes (bit i = LSB of the E2M1 code of value
    i, LSB-first) and ``scale_bytes = width // block_size`` scale bytes (E4M3 for nvfp4, E8M0 for mxfp4).

    Raises:
        InvalidIdError: bad name. ShapeError: width not a positive multiple of 8 and of ``block_size``.
        DeclarationError (a ValueError): unknown ``kind`` or ``fp4_format``.
    """

    name: str
    width: int
    kind: str = "activation"
    fp4_format: str = "nvfp4"
    block_size: int | None = None

    def __post_init__(self) -> None:
        check_name(self.name, "site name")
        if not isinstance(self.fp4_format, str) or self.fp4_format not in FP4_FORMATS:
            raise DeclarationError(f"site {self.name!r}: fp4_format {self.fp4_format!r} is not one of "
                                   f"{sorted(FP4_FORMATS)}")
        if not isinstance(self.kind, str) or self.kind not in SITE_KINDS:
            raise DeclarationError(f"site {self.name!r}: kind {self.kind!r} is not one of {list(SITE_KINDS)}")
        if self.block_size is None:
            object.__setattr__(self, "block_size", FP4_FORMATS[self.fp4_format])
        if not isinstance(self.width, (int, np.integer)) or isinstance(self.width, bool) or self.width <= 0:
            raise ShapeError(f"site {self.name!r}: width must be a positive int, got {self.width!r}")
        if (not isinstance(self.block_size, (int, np.integer)) or isinstance(self.block_size, bool)
                or self.block_size <= 0):
            raise ShapeError(f"site {self.name!r}: block_size must be a positive int, got {self.block_size!r}")
        object.__setattr__(self, "width", int(self.width))
        object.__setattr__(self, "block_size", int(self.block_size))
        if self.width % 8 or self.width % self.block_size:
            raise ShapeError(
                f"site {self.name!r}: width {self.width} must be a multiple of 8 and of block_size {self.block_size}"
            )

    @property
    def hint_bytes(self) -> int:
        return self.width // 8

    @property
    def scale_bytes(self) -> int:
        return self.width // self.block_size

    @property
    def bytes_per_token(self) -> int:
        return self.hint_bytes + self.scale_bytes

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> Site:
        """Raises DeclarationError (not a mapping, unknown keys, missing name/width) or as the constructor."""
        if not isinstance(d, Mapping):
            raise DeclarationError(f"a site must be a mapping with name and width, got {type(d).__name__} {d!r:.80}")
        unknown = sorted(set(d) - {"name", "width", "kind", "fp4_format", "block_size"})
        if unknown or "name" not in d or "width" not in d:
            raise DeclarationError(f"site {d!r:.120}: needs 'name' and 'width' and may have 'kind', 'fp4_format', "
                                   f"'block_size'" + (f"; unknown keys {unknown}" if unknown else ""))
        return cls(
            name=d["name"], width=d["width"], kind=d.get("kind", "activation"),
            fp4_format=d.get("fp4_format", "nvfp4"), block_size=d.get("block_size"),
        )


@dataclass(frozen=True)
class Snapshot:
    """A pinned log position: the first ``log_end`` log entries (``log/0 .. log/log_end-1``) of store ``store_id``."""

    store_id: str
    log_end: int

    def to_json(self) -> str:
        return json.dumps(
            {"kind": "tracestore.snapshot", "version": 1, "store_id": self.store_id, "log_end": self.log_end},
            separators=(",", ":"),
        )

    def to_cursor(self) -> str:
        """A stream cursor at this snapshot's end: ``store.stream(snap.to_cursor())`` tails what came after it."""
        return f"v1:{self.store_id}:{self.log_end}:0"

    @classmethod
    def from_json(cls, text: str) -> Snapshot:
        """Raises SnapshotError (malformed) or SchemaVersionError (unknown snapshot version)."""
        try:
            d = json.loads(text)
        except (TypeError, ValueError) as e:
            raise SnapshotError(f"snapshot is not JSON: {text!r:.80}") from e
        if not isinstance(d, dict) or d.get("kind") != "tracestore.snapshot":
            raise SnapshotError(f"not a tracestore snapshot: {text!r:.80}")
        if isinstance(d.get("version"), bool) or d.get("version") != 1:
            raise SchemaVersionError(f"snapshot version {d.get('version')!r}; supported: [1]")
        store_id, log_end = d.get("store_id"), d.get("log_end")
        if not isinstance(store_id, str) or isinstance(log_end, bool) or not isinstance(log_end, int) or log_end < 0:
            raise SnapshotError(f"malformed snapshot {text!r:.80}")
        return cls(store_id, log_end)


def _array_specs(sites: Sequence[Site], moe_layers: Sequence[str], top_k: int, num_experts: int,
                 feature_chunk: int) -> list[ArraySpec]:
    """The arrays of every segment: sites of equal (width, block size) share one hints and one scales array
    ``hints.w<width>.b<block>`` / ``scales.w<width>.b<block>`` ``[rows, n_sites, bytes]`` (declaration order
    along axis 1), then ``token_ids`` ``[rows]`` int32, ``logprobs`` ``[rows]`` float32 and, with MoE layers,
    ``experts`` ``[rows, L, top_k]`` uint8 (uint16 above 256 experts)."""
    groups: dict[tuple[int, int], list[Site]] = {}
    for s in sites:
        groups.setdefault((s.width, s.block_size), []).append(s)
    specs = []
    for (width, block), members in groups.items():
        fc = feature_chunk if (feature_chunk and width % feature_chunk == 0 and feature_chunk % block == 0
                               and feature_chunk % 8 == 0) else 0
        names = tuple(m.name for m in members)
        suffix = f"w{width}.b{block}"
        specs.append(ArraySpec(f"hints.{suffix}", np.dtype(np.uint8), (len(members), width // 8), names,
                               fc // 8 if fc else 0))
        specs.append(ArraySpec(f"scales.{suffix}", np.dtype(np.uint8), (len(members), width // block), names,
                               fc // block if fc else 0))
    specs.append(ArraySpec("token_ids", np.dtype("<i4"), ()))
    specs.append(ArraySpec("logprobs", np.dtype("<f4"), ()))
    if moe_layers:
        specs.append(ArraySpec("experts", experts_dtype(num_experts), (len(moe_layers), top_k)))
    return specs


def experts_dtype(num_experts: int) -> np.dtype:
    return np.dtype(np.uint8) if num_experts <= 256 else np.dtype("<u2")


class Store:
    """An open store. Use :func:`create_store` / :func:`open_store` to get one.

    Attributes:
        url: the store URL as given. sites: ``{name: Site}`` in declaration order. model: free-form model
        metadata. moe_layers / top_k / num_experts: routed-expert trace declaration. store_id: random id
        bound into snapshots and cursors.
    """

    def __init__(self, url: str, backend: Backend, manifest: Mapping):
        self.url = url
        self.backend = backend
        self.manifest = dict(manifest)
        self.store_id: str = manifest["store_id"]
        self.format_version: int = manifest["format_version"]
        self.sites: dict[str, Site] = {}
        for d in manifest["sites"]:
            site = Site.from_dict(d)
            self.sites[site.name] = site
        self.model: dict = dict(manifest.get("model") or {})
        self.moe_layers: tuple[str, ...] = tuple(manifest.get("moe_layers") or ())
        self.top_k: int = int(manifest.get("top_k") or 0)
        self.num_experts: int = int(manifest.get("num_experts") or 0)
        lay = manifest.get("layout") or {}
        self.chunk_rows: int = int(lay.get("chunk_rows", DEFAULT_CHUNK_ROWS))
        self.shard_bytes: int = int(lay.get("shard_bytes", DEFAULT_SHARD_BYTES))
        self.feature_chunk: int = int(lay.get("feature_chunk", 0))
        self.gc_grace_s: float = float(manifest.get("gc_grace_s", DEFAULT_GC_GRACE_S))
        self.array_specs: dict[str, ArraySpec] = {
            s.name: s for s in _array_specs(list(self.sites.values()), self.moe_layers, self.top_k,
                                            self.num_experts, self.feature_chunk)
        }
        #: site -> (hints array name, scales array name, index along axis 1)
        self.site_arrays: dict[str, tuple[str, str, int]] = {}
        for spec in self.array_specs.values():
            if spec.grouped:
                for k, m in enumerate(spec.members):
                    h, sc, _ = self.site_arrays.get(m, ("", "", k))
                    if spec.name.startswith("hints."):
                        h = spec.name
                    else:
                        sc = spec.name
                    self.site_arrays[m] = (h, sc, k)
        #: the writer's per-row buffers: name -> (dtype, row shape); "hints.<site>" / "scales.<site>" per site
        self.row_columns: dict[str, tuple[np.dtype, tuple[int, ...]]] = {}
        for site in self.sites.values():
            self.row_columns[f"hints.{site.name}"] = (np.dtype(np.uint8), (site.hint_bytes,))
            self.row_columns[f"scales.{site.name}"] = (np.dtype(np.uint8), (site.scale_bytes,))
        for spec in self.array_specs.values():
            if not spec.grouped:
                self.row_columns[spec.name] = (spec.dtype, spec.row_shape)
        self._head_hint = 0
        self._entries: list[LogEntry] = []  # decoded log entries 0..n-1 (immutable, so cached)
        self._cache_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Store({self.url!r}, sites={list(self.sites)}, format_version={self.format_version})"

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.backend.close()

    @property
    def payload_bytes_per_token(self) -> int:
        """Hint + scale bytes per token over all sites (7,680 for 20 sites x 2048 nvfp4 values)."""
        return sum(s.bytes_per_token for s in self.sites.values())

    @property
    def trace_bytes_per_token(self) -> int:
        """Token id + log-prob + routed experts bytes per token."""
        return 8 + len(self.moe_layers) * self.top_k * experts_dtype(self.num_experts).itemsize

    # ------------------------------------------------------------------ log
    def _exists_entry(self, seq: int) -> bool:
        return self.backend.exists(log_key(seq))

    def head(self) -> int:
        """Number of committed log entries: ``log/0 .. log/head-1`` exist and no entry exists after them.

        Found by galloping + binary search over ``exists`` from the last known head (O(log n) requests), then
        confirmed with one listing of the log after the candidate (S3: one ``ListObjectsV2`` with ``StartAfter``):
        an entry after a missing one means a hole, never the end of the log (FORMAT §7).

        Raises:
            IntegrityError: a log entry is missing while later ones exist (a hole).
            BackendError: the storage could not answer (after retries); never read as "absent".
        """
        lo = self._head_hint  # invariant: entries < lo exist
        while True:
            h = self._probe_head(lo)
            later = self._entries_after(h)
            if not later:
                self._note_head(h)
                return h
            # an entry after h: h was committed since it was probed (a race), or h is a hole
            if self._exists_entry(h):
                lo = h + 1
                continue
            raise IntegrityError(
                f"log entry {self.url}/{log_key(h)} is missing but later entries exist "
                f"({', '.join(log_key(n) for n in later[:3])}): a hole in the log, which hides every entry after it "
                f"(FORMAT §7); restore the entry from a backup or a checkpoint (index/) before reading or writing")

    def _probe_head(self, lo: int) -> int:
        """First absent position >= ``lo`` found by galloping + bisection (entries < ``lo`` are known to exist)."""
        if not self._exists_entry(lo):
            return lo
        step = 1
        while self._exists_entry(lo + step):
            lo += step
            step *= 2
        hi = lo + step  # lo exists, hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self._exists_entry(mid):
                lo = mid
            else:
                hi = mid
        return hi

    def _entries_after(self, seq: int) -> list[int]:
        """Positions of log entries after ``log_key(seq)`` (one listing; empty when the backend cannot list)."""
        if not self.backend.supports_listing:
            return []
        keys = self.backend.list_after(LOG_PREFIX, log_key(seq), limit=16)
        return [n for k in keys if (n := parse_log_key(k)) is not None and n > seq]

    @property
    def known_head(self) -> int:
        """The largest log head seen so far (no request): entries below it exist."""
        return self._head_hint

    def _note_head(self, n: int) -> None:
        self._head_hint = max(self._head_hint, n)

    def read_entry(self, seq: int, *, cached: bool = True) -> LogEntry:
        """Decode log entry ``seq`` (``cached=False``: re-read and re-check the stored bytes).

        Raises ObjectNotFoundError if absent, IntegrityError / SchemaVersionError."""
        with self._cache_lock:
            if cached and seq < len(self._entries):
                return self._entries[seq]
        key = log_key(seq)
        data = self.backend.get(key)
        return decode_entry(data, seq, f"{self.url}/{key}")

    def read_entries(self, lo: int, hi: int) -> list[LogEntry]:
        """Entries ``[lo, hi)``, fetched concurrently (and cached: entries are immutable).

        Raises IntegrityError if one is missing, or as :func:`decode_entry`."""
        with self._cache_lock:
            have = len(self._entries)
        if have < hi and hi - have >= CHECKPOINT_MIN_ENTRIES and lo <= have:
            self._load_checkpoint(hi)
        with self._cache_lock:
            cached = self._entries[lo:min(hi, len(self._entries))]
        out: list[LogEntry] = list(cached)
        batch = 256
        for b0 in range(lo + len(cached), hi, batch):
            seqs = list(range(b0, min(hi, b0 + batch)))
            keys = [log_key(s) for s in seqs]
            datas = self.backend.get_many(keys)
            for seq, key, data in zip(seqs, keys, datas):
                if data is None:
                    raise IntegrityError(f"log entry {self.url}/{key} is missing below the log head")
                out.append(decode_entry(data, seq, f"{self.url}/{key}"))
        with self._cache_lock:
            if lo <= len(self._entries) < hi:  # extend the dense cached prefix
                self._entries.extend(out[len(self._entries) - lo:])
        self._note_head(hi)
        return out

    def checkpoints(self) -> list[int]:
        """``log_end`` of every checkpoint object (``index/<log_end>.parquet``), ascending (one listing)."""
        if not self.backend.supports_listing:
            return []
        return sorted(n for o in self.backend.list(INDEX_PREFIX) if (n := parse_checkpoint_key(o.key)) is not None)

    def _load_checkpoint(self, hi: int) -> None:
        """Fill the entry cache from the newest usable checkpoint with ``log_end <= hi`` (if it saves reads).
        A checkpoint that fails its checks is skipped with a warning: the log entries are the source of truth."""
        try:
            ends = [n for n in self.checkpoints() if n <= hi]
        except TraceStoreError as e:
            log.warning("%s: cannot list checkpoints: %s", self.url, e)
            return
        with self._cache_lock:
            have = len(self._entries)
        for n in reversed(ends):
            if n - have < CHECKPOINT_MIN_ENTRIES:
                return
            key = checkpoint_key(n)
            try:
                entries = decode_checkpoint(self.backend.get(key), n, f"{self.url}/{key}")
            except TraceStoreError as e:  # IntegrityError, SchemaVersionError, BackendError
                log.warning("ignoring checkpoint %s/%s: %s", self.url, key, e)
                continue
            with self._cache_lock:
                if len(self._entries) < n:
                    self._entries = entries
            self._note_head(n)
            return

    def compact(self) -> int | None:
        """Write a checkpoint of the whole log (``index/<head>.parquet``) so that new readers and writers load
        one object instead of one per entry. Returns its ``log_end``, or None when the log is empty or a
        checkpoint at the head exists. Safe to run concurrently with writers (the checkpoint is immutable and
        covers a prefix of the log)."""
        head = self.head()
        if head == 0:
            return None
        key = checkpoint_key(head)
        if self.backend.exists(key):
            return None
        data = encode_checkpoint(self.read_entries(0, head))
        return head if self.backend.put_if_absent(key, data) else None

    # ------------------------------------------------------------------ public API
    def snapshot(self) -> Snapshot:
        """Pin the current log position."""
        return Snapshot(self.store_id, self.head())

    def writer(self, writer_id: str | None = None, *, commit_bytes: int = 64 << 20, commit_interval_s: float = 5.0,
               max_buffer_bytes: int = 256 << 20, skip_committed: bool = False, commit_timeout_s: float = 120.0):
        """A :class:`~tracestore.writer.Writer` (context manager). See there."""
        from .writer import Writer

        return Writer(self, writer_id, commit_bytes=commit_bytes, commit_interval_s=commit_interval_s,
                      max_buffer_bytes=max_buffer_bytes, skip_committed=skip_committed,
                      commit_timeout_s=commit_timeout_s)

    def reader(self, snapshot: Snapshot | str | None = None):
        """A :class:`~tracestore.reader.Reader` over ``snapshot`` (default: the current head)."""
        from .reader import Reader

        return Reader(self, snapshot)

    def stream(self, cursor: str | None = None, *, poll_interval_s: float = 0.05, timeout_s: float | None = None):
        """A :class:`~tracestore.reader.Stream` tailing the log from ``cursor`` (default: the beginning)."""
        from .reader import Stream

        return Stream(self, cursor, poll_interval_s=poll_interval_s, timeout_s=timeout_s)

    def check_snapshot(self, snapshot: Snapshot | str | None) -> Snapshot:
        if snapshot is None:
            return self.snapshot()
        if isinstance(snapshot, str):
            snapshot = Snapshot.from_json(snapshot)
        if snapshot.store_id != self.store_id:
            raise SnapshotError(f"snapshot belongs to store {snapshot.store_id}, not {self.store_id} ({self.url})")
        if snapshot.log_end > self._head_hint and snapshot.log_end > self.head():
            raise SnapshotError(f"snapshot log_end {snapshot.log_end} is past the log head {self.head()} of {self.url}")
        return snapshot


# ---------------------------------------------------------------------- create / open
def _manifest(sites: Sequence[Site], model: Mapping | None, moe_layers: Sequence[str], top_k: int, num_experts: int,
              chunk_rows: int, shard_bytes: int, feature_chunk: int, gc_grace_s: float) -> dict:
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "store_id": uuid.uuid4().hex,
        "created_unix": time.time(),
        "sites": [s.to_dict() for s in sites],
        "model": dict(model or {}),
        "moe_layers": list(moe_layers),
        "top_k": int(top_k),
        "num_experts": int(num_experts),
        "layout": {"chunk_rows": int(chunk_rows), "shard_bytes": int(shard_bytes), "feature_chunk": int(feature_chunk)},
        "gc_grace_s": float(gc_grace_s),
    }


#: manifest value limits (a damaged or hostile manifest must not make writers loop or readers crash)
MAX_CHUNK_ROWS = 1 << 24
MAX_SHARD_BYTES = 1 << 40
MAX_EXPERTS = 65536
_STORE_ID_RE = re.compile(r"[A-Za-z0-9]{1,64}")


def _int_in(m: Mapping, key: str, lo: int, hi: int, where: str, default: int | None = None) -> int:
    value = m.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise DeclarationError(f"{where}{key} must be an integer in [{lo}, {hi}], got {value!r:.80}")
    return value


def check_gc_grace(value: object, what: str = "gc_grace_s") -> float:
    """A gc grace period: a finite number of seconds > 0. Raises DeclarationError otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise DeclarationError(f"{what} must be a finite number of seconds > 0, got {value!r:.80}")
    return float(value)


def check_manifest(m: object) -> None:
    """Check every value of a manifest (types and ranges, FORMAT §2.1) before anything trusts it.

    Raises:
        DeclarationError: the first bad value, with what arrived and what is allowed.
        SchemaVersionError: an unsupported ``format_version``.
    """
    if not isinstance(m, Mapping):
        raise DeclarationError(f"the manifest must be a JSON object, got {type(m).__name__}")
    if m.get("format") != FORMAT_NAME:
        raise DeclarationError(f"format must be {FORMAT_NAME!r}, got {m.get('format')!r:.80}")
    version = m.get("format_version")
    if isinstance(version, bool) or version not in SUPPORTED_FORMAT_VERSIONS:
        raise SchemaVersionError(
            f"format_version {version!r:.40}; this tracestore writes version {FORMAT_VERSION} and reads versions "
            f"{list(SUPPORTED_FORMAT_VERSIONS)}")
    store_id = m.get("store_id")
    if not isinstance(store_id, str) or not _STORE_ID_RE.fullmatch(store_id):
        raise DeclarationError(f"store_id must be 1-64 letters/digits, got {store_id!r:.80}")
    sites = m.get("sites")
    if not isinstance(sites, list) or not sites:
        raise DeclarationError(f"sites must be a non-empty list, got {sites!r:.80}")
    names = [Site.from_dict(d).name for d in sites]
    if len(set(names)) != len(names):
        raise DeclarationError(f"duplicate site names in {names}")
    if not isinstance(m.get("model", {}), Mapping):
        raise DeclarationError(f"model must be a JSON object, got {m.get('model')!r:.80}")
    layers = m.get("moe_layers", [])
    if not isinstance(layers, list):
        raise DeclarationError(f"moe_layers must be a list of names, got {layers!r:.80}")
    try:
        layers = [check_name(n, "MoE layer name") for n in layers]
    except TraceStoreError as e:
        raise DeclarationError(str(e)) from e
    if len(set(layers)) != len(layers):
        raise DeclarationError(f"duplicate MoE layer names in {layers}")
    if layers:
        num_experts = _int_in(m, "num_experts", 1, MAX_EXPERTS, "")
        _int_in(m, "top_k", 1, num_experts, "")
    else:
        _int_in(m, "num_experts", 0, MAX_EXPERTS, "", 0)
        _int_in(m, "top_k", 0, MAX_EXPERTS, "", 0)
    lay = m.get("layout", {})
    if not isinstance(lay, Mapping):
        raise DeclarationError(f"layout must be a JSON object, got {lay!r:.80}")
    _int_in(lay, "chunk_rows", 1, MAX_CHUNK_ROWS, "layout.", DEFAULT_CHUNK_ROWS)
    _int_in(lay, "shard_bytes", 1, MAX_SHARD_BYTES, "layout.", DEFAULT_SHARD_BYTES)
    _int_in(lay, "feature_chunk", 0, 1 << 20, "layout.", 0)
    check_gc_grace(m.get("gc_grace_s", DEFAULT_GC_GRACE_S))


def _declaration(m: Mapping) -> tuple:
    return (m["sites"], m.get("moe_layers", []), m.get("top_k", 0), m.get("num_experts", 0))


def create_store(url: str, sites: Sequence[Site], *, model: Mapping | None = None, moe_layers: Sequence[str] = (),
                 top_k: int = 0, num_experts: int = 0, storage_options: Mapping | None = None,
                 exist_ok: bool = False, chunk_rows: int = DEFAULT_CHUNK_ROWS, shard_bytes: int = DEFAULT_SHARD_BYTES,
                 feature_chunk: int = 0, gc_grace_s: float = DEFAULT_GC_GRACE_S,
                 retry: RetryPolicy | None = None) -> Store:
    """Create a store at ``url`` declaring its sites and model metadata.

    ``chunk_rows`` (target rows per inner Zarr chunk), ``shard_bytes`` (target bytes per shard object) and
    ``feature_chunk`` (values per chunk along the feature axis; 0 = a whole row, else chunks of that many values
    for sites whose width it divides — for tensor-parallel slicing) fix the layout of every segment.

    Raises:
        StoreExistsError: a store exists at ``url`` (and ``exist_ok`` is false, or it declares other sites).
        InvalidIdError / ShapeError / ValueError: bad declaration. BackendError: storage failure.
    """
    sites = list(sites)
    if not sites or not all(isinstance(s, Site) for s in sites):
        raise ShapeError(f"create_store needs a non-empty sequence of Site, got {sites!r:.200}")
    names = [s.name for s in sites]
    if len(set(names)) != len(names):
        raise ShapeError(f"duplicate site names in {names}")
    moe_layers = [check_name(n, "MoE layer name") for n in moe_layers]
    if len(set(moe_layers)) != len(moe_layers):
        raise ShapeError(f"duplicate MoE layer names in {moe_layers}")
    if moe_layers and (top_k <= 0 or num_experts <= 0 or num_experts > 65536 or top_k > num_experts):
        raise ShapeError(f"MoE layers need 0 < top_k <= num_experts <= 65536, got top_k={top_k}, num_experts={num_experts}")
    if chunk_rows <= 0 or shard_bytes <= 0 or feature_chunk < 0:
        raise ShapeError(f"bad layout: chunk_rows={chunk_rows}, shard_bytes={shard_bytes}, feature_chunk={feature_chunk}")
    try:
        json.dumps(dict(model or {}), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"model metadata must be JSON-serialisable: {e}") from e
    manifest = _manifest(sites, model, moe_layers, top_k, num_experts, chunk_rows, shard_bytes, feature_chunk,
                         check_gc_grace(gc_grace_s))
    check_manifest(manifest)
    backend = open_backend(url, storage_options, retry=retry)
    data = json.dumps(manifest, indent=1, sort_keys=True).encode()
    if backend.put_if_absent(MANIFEST_KEY, data):
        log.info("created store %s (%d sites)", url, len(sites))
        return Store(url, backend, manifest)
    existing = open_store(url, storage_options=storage_options, retry=retry)
    if not exist_ok:
        raise StoreExistsError(f"a tracestore store already exists at {url} (pass exist_ok=True to open it)")
    if _declaration(existing.manifest) != _declaration(manifest):
        raise StoreExistsError(
            f"the store at {url} declares sites {list(existing.sites)} / moe_layers {list(existing.moe_layers)} "
            f"(top_k {existing.top_k}, num_experts {existing.num_experts}); create_store asked for sites {names} / "
            f"moe_layers {moe_layers} (top_k {top_k}, num_experts {num_experts})"
        )
    return existing


def open_store(url: str, *, storage_options: Mapping | None = None, retry: RetryPolicy | None = None) -> Store:
    """Open an existing store, checking the manifest's format version first.

    ``retry`` says how transient storage errors are retried (default :data:`~tracestore.backend.DEFAULT_RETRY`).

    Raises:
        StoreNotFoundError: no manifest at ``url``. SchemaVersionError: unsupported format version.
        IntegrityError: the manifest is not valid JSON, or a value has the wrong type or is out of range.
        BackendError: storage failure (a typed subclass: LocationError, CredentialsError, EndpointError, ...).
    """
    backend = open_backend(url, storage_options, retry=retry)
    try:
        raw = backend.get(MANIFEST_KEY)
    except ObjectNotFoundError as e:
        raise StoreNotFoundError(f"no tracestore store at {url} ({MANIFEST_KEY} not found)") from e
    try:
        manifest = json.loads(raw)
    except ValueError as e:
        raise IntegrityError(f"{url}/{MANIFEST_KEY} is not valid JSON: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise IntegrityError(f"{url}/{MANIFEST_KEY} is not a tracestore manifest (format={manifest.get('format') if isinstance(manifest, dict) else None!r})")
    try:
        check_manifest(manifest)
    except SchemaVersionError as e:
        raise SchemaVersionError(f"store {url}: {e}") from None
    except TraceStoreError as e:
        raise IntegrityError(f"{url}/{MANIFEST_KEY}: {e}") from e
    try:
        return Store(url, backend, manifest)
    except (KeyError, TypeError, ValueError, TraceStoreError) as e:
        raise IntegrityError(f"{url}/{MANIFEST_KEY}: malformed manifest: {e}") from e

