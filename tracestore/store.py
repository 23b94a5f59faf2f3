"""Stores: create/open by URL, the declared site table and model metadata, the log head, snapshots.

See ``schemas/FORMAT.md`` for the layout. A :class:`Store` is cheap; it holds the backend and the manifest and
hands out writers, readers and streams.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence

import numpy as np

from ._closing import Closing
from .format.keys import (
    DEFAULT_CHUNK_ROWS,
    DEFAULT_GC_GRACE_S,
    DEFAULT_SHARD_BYTES,
    BASE_FORMAT_VERSION,
    MANIFEST_KEY,
    check_name,
    check_version,
)
from .format.cursor import Snapshot
from .format.manifest import (
    Site,
    array_specs,
    check_gc_grace,
    check_manifest,
    declaration,
    decode_manifest,
    experts_dtype,
    new_manifest,
    required_version,
)
from .format.entries import LogEntry
from .format.segment import ArraySpec
from .commit_log import CommitLog
from .objects import ObjectArea
from .reader import Reader
from .stream import Stream
from .writer import Writer
from .storage import Backend, RetryPolicy, open_backend
from .errors import (
    IntegrityError,
    LocationError,
    ObjectNotFoundError,
    SchemaVersionError,
    ShapeError,
    OptionTypeError,
    SnapshotError,
    StoreExistsError,
    StoreNotFoundError,
    TraceStoreError,
)

__all__ = ["Site", "Store", "Snapshot", "create_store", "open_store"]

log = logging.getLogger(__name__)


class Store(Closing):
    """An open store. Use :func:`create_store` / :func:`open_store` to get one.

    Attributes:
        url: the store URL as given. sites: ``{name: Site}`` in declaration order. model: free-form model
        metadata. moe_layers / top_k / num_experts: routed-expert trace declaration. store_id: random id
        bound into snapshots and cursors.
    """

    def __init__(self, url: str, backend: Backend, manifest: Mapping, storage_options: Mapping | None = None):
        self.url = url
        self.backend = backend
        self._storage_options = dict(storage_options or {})
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
            s.name: s for s in array_specs(list(self.sites.values()), self.moe_layers, self.top_k,
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
        #: margin sites (hint_encoding "margin", FORMAT §2.5) -> (row ends array name, rows array name)
        self.margin_arrays: dict[str, tuple[str, str]] = {
            s.name: (f"margin_ends.{s.name}", f"margin.{s.name}") for s in self.sites.values() if s.is_margin}
        #: the writer's per-row buffers: name -> (dtype, row shape); "hints.<site>" / "scales.<site>" per bits site,
        #: "margin_ends.<site>" per margin site (its rows' bytes are buffered apart: they vary per row)
        self.row_columns: dict[str, tuple[np.dtype, tuple[int, ...]]] = {}
        for site in self.sites.values():
            if not site.is_margin:
                self.row_columns[f"hints.{site.name}"] = (np.dtype(np.uint8), (site.hint_bytes,))
                self.row_columns[f"scales.{site.name}"] = (np.dtype(np.uint8), (site.scale_bytes,))
        for spec in self.array_specs.values():
            if not spec.grouped and not spec.ends:
                self.row_columns[spec.name] = (spec.dtype, spec.row_shape)
        #: the commit log (head, entry cache, checkpoints), shared by this store's writers, readers and streams
        self.log = CommitLog(backend, url, self.format_version)

    def __repr__(self) -> str:
        return f"Store({self.url!r}, sites={list(self.sites)}, format_version={self.format_version})"

    def close(self) -> None:
        self.backend.close()

    @property
    def payload_bytes_per_token(self) -> int:
        """Fixed payload bytes per token over all sites: hint + scale bytes (7,680 for 20 sites x 2048 nvfp4
        values), 4 per margin site (its row end; the rows themselves vary)."""
        return sum(s.bytes_per_token for s in self.sites.values())

    @property
    def trace_bytes_per_token(self) -> int:
        """Token id + log-prob + routed experts bytes per token."""
        return 8 + len(self.moe_layers) * self.top_k * experts_dtype(self.num_experts).itemsize

    # ------------------------------------------------------------------ log (see CommitLog)
    def head(self) -> int:
        """Number of committed log entries (:meth:`CommitLog.head`: raises IntegrityError on a hole)."""
        return self.log.head()

    @property
    def known_head(self) -> int:
        """The largest log head seen so far (no request)."""
        return self.log.known_head

    def read_entry(self, seq: int, *, cached: bool = True) -> LogEntry:
        """Log entry ``seq`` (:meth:`CommitLog.read_entry`)."""
        return self.log.read_entry(seq, cached=cached)

    def read_entries(self, lo: int, hi: int) -> list[LogEntry]:
        """Log entries ``[lo, hi)`` (:meth:`CommitLog.read_entries`)."""
        return self.log.read_entries(lo, hi)

    def checkpoints(self) -> list[int]:
        """``log_end`` of every checkpoint (:meth:`CommitLog.checkpoints`)."""
        return self.log.checkpoints()

    def compact(self) -> int | None:
        """Write a checkpoint of the whole log (:meth:`CommitLog.compact`)."""
        return self.log.compact()

    # ------------------------------------------------------------------ public API
    def snapshot(self) -> Snapshot:
        """Pin the current log position."""
        return Snapshot(self.store_id, self.head())

    def writer(self, writer_id: str | None = None, *, commit_bytes: int = 64 << 20, commit_interval_s: float = 5.0,
               max_buffer_bytes: int = 256 << 20, skip_committed: bool = False, commit_timeout_s: float = 120.0):
        """A :class:`~tracestore.writer.Writer` (context manager). See there."""
        return Writer(self, writer_id, commit_bytes=commit_bytes, commit_interval_s=commit_interval_s,
                      max_buffer_bytes=max_buffer_bytes, skip_committed=skip_committed,
                      commit_timeout_s=commit_timeout_s)

    def reader(self, snapshot: Snapshot | str | None = None):
        """A :class:`~tracestore.reader.Reader` over ``snapshot`` (default: the current head)."""
        return Reader(self, snapshot)

    def stream(self, cursor: str | None = None, *, poll_interval_s: float = 0.05, timeout_s: float | None = None):
        """A :class:`~tracestore.stream.Stream` tailing the log from ``cursor`` (default: the beginning)."""
        return Stream(self, cursor, poll_interval_s=poll_interval_s, timeout_s=timeout_s)

    def open_args(self) -> tuple[str, dict, RetryPolicy]:
        """``(url, storage_options, retry)``: what `open_store` takes to open this store again, e.g. in another
        process (``open_store(url, storage_options=..., retry=...)``).

        Raises:
            LocationError: an in-memory store (``memory://``), which lives in its process alone.
        """
        if self.url.startswith("memory://"):
            raise LocationError(f"the store {self.url} is in this process's memory: no other process can open it")
        return self.url, dict(self._storage_options), self.backend.retry

    def area(self, area: str):
        """The application area ``area`` beside this store (an :class:`~tracestore.objects.ObjectArea` on the
        store's backend, with its retries and typed errors; closing the area leaves the store open). Raises
        InvalidIdError for a bad name or one the store format owns (FORMAT §2)."""
        return ObjectArea(self.backend, self.url, area)

    def check_snapshot(self, snapshot: Snapshot | str | None) -> Snapshot:
        if snapshot is None:
            return self.snapshot()
        if isinstance(snapshot, str):
            snapshot = Snapshot.from_json(snapshot)
        if snapshot.store_id != self.store_id:
            raise SnapshotError(f"snapshot belongs to store {snapshot.store_id}, not {self.store_id} ({self.url})")
        if snapshot.log_end > self.log.known_head and snapshot.log_end > self.head():
            raise SnapshotError(f"snapshot log_end {snapshot.log_end} is past the log head {self.head()} of {self.url}")
        return snapshot


# ---------------------------------------------------------------------- create / open
def create_store(url: str, sites: Sequence[Site], *, model: Mapping | None = None, moe_layers: Sequence[str] = (),
                 top_k: int = 0, num_experts: int = 0, storage_options: Mapping | None = None,
                 exist_ok: bool = False, chunk_rows: int = DEFAULT_CHUNK_ROWS, shard_bytes: int = DEFAULT_SHARD_BYTES,
                 feature_chunk: int = 0, gc_grace_s: float = DEFAULT_GC_GRACE_S,
                 retry: RetryPolicy | None = None, format_version: int | None = None) -> Store:
    """Create a store at ``url`` declaring its sites and model metadata.

    ``chunk_rows`` (target rows per inner Zarr chunk), ``shard_bytes`` (target bytes per shard object) and
    ``feature_chunk`` (values per chunk along the feature axis; 0 = a whole row, else chunks of that many values
    for sites whose width it divides — for tensor-parallel slicing) fix the layout of every segment.
    ``format_version``: default the lowest version that holds the declaration (FORMAT §7): 3, 4 when a site's
    ``scale_encoding`` is not ``bytes``, 5 when a site's ``hint_encoding`` is ``margin``; an older one keeps the
    store readable by older readers.

    Raises:
        StoreExistsError: a store exists at ``url`` (and ``exist_ok`` is false, or it declares other sites).
        InvalidIdError / ShapeError / DeclarationError: bad declaration (all ValueErrors). OptionTypeError: ``model``
        is not JSON. SchemaVersionError: an unsupported ``format_version``; DeclarationError: a site's scale or hint
        encoding that ``format_version`` does not have. BackendError: storage failure.
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
        raise OptionTypeError(f"model metadata must be a JSON-serialisable mapping, got {type(model).__name__} that is "
                              f"not: {e}") from e
    if format_version is None:
        format_version = required_version(sites, BASE_FORMAT_VERSION)
    check_version(format_version, "create_store(format_version=...)")
    manifest = new_manifest(sites, model, moe_layers, top_k, num_experts, chunk_rows, shard_bytes, feature_chunk,
                         check_gc_grace(gc_grace_s), format_version)
    check_manifest(manifest)
    backend = open_backend(url, storage_options, retry=retry)
    data = json.dumps(manifest, indent=1, sort_keys=True).encode()
    if backend.put_if_absent(MANIFEST_KEY, data):
        log.info("created store %s (%d sites)", url, len(sites))
        return Store(url, backend, manifest, storage_options)
    existing = open_store(url, storage_options=storage_options, retry=retry)
    if not exist_ok:
        raise StoreExistsError(f"a tracestore store already exists at {url} (pass exist_ok=True to open it)")
    if declaration(existing.manifest) != declaration(manifest):
        raise StoreExistsError(
            f"the store at {url} declares sites {list(existing.sites)} / moe_layers {list(existing.moe_layers)} "
            f"(top_k {existing.top_k}, num_experts {existing.num_experts}); create_store asked for sites {names} / "
            f"moe_layers {moe_layers} (top_k {top_k}, num_experts {num_experts})"
        )
    return existing


def open_store(url: str, *, storage_options: Mapping | None = None, retry: RetryPolicy | None = None) -> Store:
    """Open an existing store, checking the manifest's format version first.

    ``retry`` says how transient storage errors are retried (default :data:`~tracestore.storage.DEFAULT_RETRY`).

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
        manifest = decode_manifest(raw, f"{url}/{MANIFEST_KEY}")
    except SchemaVersionError as e:
        raise SchemaVersionError(f"store {url}: {e} (format_version)") from None
    try:
        return Store(url, backend, manifest, storage_options)
    except (KeyError, TypeError, ValueError, TraceStoreError) as e:
        raise IntegrityError(f"{url}/{MANIFEST_KEY}: malformed manifest: {e}") from e

