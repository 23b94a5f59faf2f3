"""Segments: the Zarr v3 groups that hold the payload, encoded and decoded without going through zarr-python.

One segment is one Zarr v3 group written once by one writer flush. Each array in it has exactly ``rows`` rows,
one ``sharding_indexed`` codec, inner chunks of ``[chunk_rows, col_chunk]`` (or ``[chunk_rows]`` /
``[chunk_rows, L, K]``) encoded ``bytes`` + ``crc32c`` (raw little-endian values followed by the crc32c of those
bytes, 4 bytes little-endian) and a shard index encoded ``bytes`` + ``crc32c`` at the end of the shard.

tracestore writes every shard in one piece with its inner chunks in C order of the chunk grid and no gaps, so
the byte offset of chunk ``(i, j)`` inside its shard is ``(i_local * n_col + j) * (chunk_nbytes + 4)``: readers
fetch exactly the chunks they need with range requests and never read the shard index (``verify`` checks that
the index says the same). Plain zarr-python reads the same bytes through the index.
"""

from __future__ import annotations

import functools
import json
import math
import struct
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import crc32c as _crc32c
import numpy as np

from ..storage.base import ByteRange
from ..errors import IntegrityError

_MISSING = np.uint64(2**64 - 1)
_CRC = 4  # bytes of a crc32c checksum


def crc32c(data) -> int:
    return _crc32c.crc32c(data)


@dataclass(frozen=True)
class ArraySpec:
    """What a segment array holds per row: ``name``, numpy ``dtype`` and trailing ``row_shape``.

    Site arrays group all sites of one (width, block size): ``members`` names the sites along axis 1, the
    row shape is ``(len(members), bytes)`` and inner chunks are ``[chunk_rows, 1, col_chunk]`` (one site, a
    ``col_chunk``-byte slice of it; 0 = all bytes). Other arrays (``members == ()``) have one inner chunk per
    ``chunk_rows`` rows. A margin site's rows array (``ends`` = the name of its ``margin_ends`` array) is 1-D
    uint8 with one element per *byte*: its length is the segment's last row end, its inner chunks
    ``margin_chunk_bytes(chunk_rows)`` bytes (:func:`margin_layout`).
    """

    name: str
    dtype: np.dtype
    row_shape: tuple[int, ...]
    members: tuple[str, ...] = ()
    col_chunk: int = 0
    ends: str = ""

    @property
    def row_nbytes(self) -> int:
        return math.prod(self.row_shape) * self.dtype.itemsize  # math.prod: np.prod costs ~10 us per call

    @functools.cached_property
    def grouped(self) -> bool:
        return bool(self.members)


@dataclass(frozen=True)
class ArrayLayout:
    """The concrete Zarr layout of one array of one segment.

    Inner chunks are addressed ``(i, f)``: row chunk ``i`` and flat index ``f`` over the chunk grid of the
    trailing dimensions (site arrays: ``f = site_index * n_col + column_chunk``; others: ``f = 0``).
    """

    spec: ArraySpec
    rows: int
    chunk_rows: int
    shard_rows: int

    @property
    def name(self) -> str:
        return self.spec.name

    @functools.cached_property
    def width(self) -> int:
        """Bytes per site row of a site array (0 for other arrays)."""
        return self.spec.row_shape[1] if self.spec.grouped else 0

    @functools.cached_property
    def col_chunk(self) -> int:
        return (self.spec.col_chunk or self.width) if self.spec.grouped else 0

    @functools.cached_property
    def n_col(self) -> int:
        return self.width // self.col_chunk if self.spec.grouped else 1

    @functools.cached_property
    def inner_shape(self) -> tuple[int, ...]:
        return (1, self.col_chunk) if self.spec.grouped else self.spec.row_shape

    @functools.cached_property
    def inner_grid(self) -> tuple[int, ...]:
        return (len(self.spec.members), self.n_col) if self.spec.grouped else (1,) * len(self.spec.row_shape)

    @functools.cached_property
    def n_inner(self) -> int:
        return int(np.prod(self.inner_grid, dtype=np.int64))

    @functools.cached_property
    def chunk_shape(self) -> tuple[int, ...]:
        return (self.chunk_rows, *self.inner_shape)

    @functools.cached_property
    def chunk_nbytes(self) -> int:
        return int(np.prod(self.chunk_shape, dtype=np.int64)) * self.spec.dtype.itemsize

    @functools.cached_property
    def stored_chunk_nbytes(self) -> int:
        return self.chunk_nbytes + _CRC

    @functools.cached_property
    def chunks_per_shard(self) -> int:
        return self.shard_rows // self.chunk_rows

    @functools.cached_property
    def n_shards(self) -> int:
        return math.ceil(self.rows / self.shard_rows)

    def shard_rows_of(self, shard: int) -> tuple[int, int, int]:
        """Rows ``[r0, r1)`` of ``shard`` and its number of row chunks present (the last shard may be short)."""
        r0 = shard * self.shard_rows
        r1 = min(r0 + self.shard_rows, self.rows)
        return r0, r1, math.ceil((r1 - r0) / self.chunk_rows)

    def shard_key(self, shard: int) -> str:
        # chunk_key_encoding "v2" with separator ".": one directory per array, shards named "<i>[.0[.0]]"
        return f"{self.name}/{shard}" + ".0" * len(self.spec.row_shape)

    def zarr_metadata(self) -> dict:
        dt = self.spec.dtype
        inner_bytes: dict = {"name": "bytes"}
        if dt.itemsize > 1:
            inner_bytes["configuration"] = {"endian": "little"}
        attrs = {"tracestore": {"sites": list(self.spec.members)}} if self.spec.grouped else {}
        return {
            "zarr_format": 3,
            "node_type": "array",
            "shape": [self.rows, *self.spec.row_shape],
            "data_type": dt.name,
            "chunk_grid": {
                "name": "regular",
                "configuration": {"chunk_shape": [self.shard_rows, *self.spec.row_shape]},
            },
            "chunk_key_encoding": {"name": "v2", "configuration": {"separator": "."}},
            "fill_value": 0,
            "codecs": [
                {
                    "name": "sharding_indexed",
                    "configuration": {
                        "chunk_shape": list(self.chunk_shape),
                        "codecs": [inner_bytes, {"name": "crc32c"}],
                        "index_codecs": [
                            {"name": "bytes", "configuration": {"endian": "little"}},
                            {"name": "crc32c"},
                        ],
                        "index_location": "end",
                    },
                }
            ],
            "attributes": attrs,
            "storage_transformers": [],
        }

    # ------------------------------------------------------------------ writing
    def _chunk(self, sources: Sequence[np.ndarray], i: int, f: int, r_end: int):
        """Bytes of inner chunk ``(i, f)``: a memoryview into ``sources`` where contiguous, else a padded copy."""
        cr = self.chunk_rows
        a, b = i * cr, min((i + 1) * cr, r_end)
        if self.spec.grouped:
            s, j = divmod(f, self.n_col)
            block = sources[s][a:b, j * self.col_chunk : (j + 1) * self.col_chunk]
        else:
            block = sources[0][a:b]
        if b - a < cr:  # the array's last inner chunk: pad with the fill value 0
            padded = np.zeros((cr, *block.shape[1:]), dtype=self.spec.dtype)
            padded[: b - a] = block
            block = padded
        elif not block.flags.c_contiguous:
            block = np.ascontiguousarray(block)
        return memoryview(block).cast("B")

    def _index(self, n_present: int) -> bytes:
        n = n_present * self.n_inner
        index = np.full((self.chunks_per_shard * self.n_inner, 2), _MISSING, dtype="<u8")
        index[:n, 0] = np.arange(n, dtype=np.uint64) * np.uint64(self.stored_chunk_nbytes)
        index[:n, 1] = self.stored_chunk_nbytes
        ib = index.tobytes()
        return ib + struct.pack("<I", crc32c(ib))

    def encode_parts(self, sources: Sequence[np.ndarray], crcs: Sequence[Sequence[int]] | None = None
                     ) -> dict[str, list]:
        """Encode the array -> ``{shard key: gather list}``; ``[chunk, crc, chunk, crc, ..., index + crc]``.

        ``sources``: site arrays: one ``[rows, bytes]`` uint8 array per member site; others: ``[data]`` with
        ``data`` of shape ``[rows, *row_shape]``. Chunks reference the sources without copying where they are
        contiguous (site arrays without column chunking, all other arrays). ``crcs`` (optional, only without
        column chunking): per source, the crc32c of its first whole chunks of ``chunk_rows`` rows, computed
        while the rows were buffered; the other chunks' checksums are computed here.
        """
        if crcs is not None:
            assert self.n_col == 1 and len(crcs) == len(sources), (self.n_col, len(crcs), len(sources))
        want = (self.rows, self.width) if self.spec.grouped else (self.rows, *self.spec.row_shape)
        assert len(sources) == (len(self.spec.members) if self.spec.grouped else 1)
        assert all(x.shape == want and x.dtype == self.spec.dtype for x in sources), (want, self.spec)
        out: dict[str, list] = {}
        for s in range(self.n_shards):
            r0, r1, n_present = self.shard_rows_of(s)
            parts: list = []
            i0 = r0 // self.chunk_rows
            for i in range(i0, i0 + n_present):
                for f in range(self.n_inner):
                    chunk = self._chunk(sources, i, f, r1)
                    parts.append(chunk)
                    known = crcs[f] if crcs is not None else ()
                    if i < len(known) and (i + 1) * self.chunk_rows <= r1:
                        parts.append(struct.pack("<I", known[i]))
                    else:
                        parts.append(struct.pack("<I", crc32c(chunk)))
            parts.append(self._index(n_present))
            out[self.shard_key(s)] = parts
        return out

    def expected_index(self, shard: int) -> tuple[int, bytes]:
        """(shard size in bytes, index bytes incl. crc) that tracestore writes for ``shard`` (for ``verify``)."""
        _r0, _r1, n_present = self.shard_rows_of(shard)
        ib = self._index(n_present)
        return n_present * self.n_inner * self.stored_chunk_nbytes + len(ib), ib

    # ------------------------------------------------------------------ reading
    def flat_ranges(self, columns: Iterable[tuple[int, int, int]]) -> list[tuple[int, int]]:
        """The inner-chunk index ranges ``[f0, f1)`` (for :meth:`plan`) that hold bytes ``[b0, b1)`` of the sites
        ``k`` in ``columns`` (``(k, b0, b1)`` per site of a site array), in order, overlapping or touching ones
        merged so that each becomes one range request per row chunk."""
        flats: list[tuple[int, int]] = []
        for k, b0, b1 in sorted(columns):
            f0 = k * self.n_col + b0 // self.col_chunk
            f1 = k * self.n_col + -(-b1 // self.col_chunk)
            if flats and flats[-1][1] >= f0:
                flats[-1] = (flats[-1][0], max(flats[-1][1], f1))
            else:
                flats.append((f0, f1))
        return flats

    def plan(self, prefix: str, r0: int, r1: int, flats: Sequence[tuple[int, int]] | None = None
             ) -> list[tuple[ByteRange, list]]:
        """Byte ranges covering rows ``[r0, r1)`` and the inner-chunk index ranges ``flats`` (default all).

        Returns ``[(ByteRange, [(i, f), ...]), ...]``: each range holds consecutive stored chunks in that order.
        """
        n_inner = self.n_inner
        flats = [(0, n_inner)] if flats is None else list(flats)
        full = flats == [(0, n_inner)]
        cps, scb = self.chunks_per_shard, self.stored_chunk_nbytes
        out = []
        i_first, i_last = r0 // self.chunk_rows, (r1 - 1) // self.chunk_rows
        i = i_first
        while i <= i_last:
            s = i // cps
            i_end = min(i_last, (s + 1) * cps - 1)
            key = f"{prefix}/{self.shard_key(s)}"
            if full:
                start = (i - s * cps) * n_inner * scb
                stop = (i_end - s * cps + 1) * n_inner * scb
                chunks = [(ii, f) for ii in range(i, i_end + 1) for f in range(n_inner)]
                out.append((ByteRange(key, start, stop), chunks))
            else:
                for ii in range(i, i_end + 1):
                    base = (ii - s * cps) * n_inner
                    for f0, f1 in flats:
                        out.append((ByteRange(key, (base + f0) * scb, (base + f1) * scb),
                                    [(ii, f) for f in range(f0, f1)]))
            i = i_end + 1
        return out


_arena = threading.local()


def _scratch(nbytes: int) -> np.ndarray:
    """A per-thread reusable scratch buffer of at least ``nbytes`` (reused across reads: no page faults)."""
    buf = getattr(_arena, "buf", None)
    if buf is None or buf.size < nbytes:
        buf = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
        _arena.buf = buf
    return buf


class _ReadItem(NamedTuple):
    """One range request of a read plan: ``rng`` holds ``chunks`` (``[(row chunk, inner index), ...]``) of the
    array laid out as ``lay``; rows ``[r0, r1)`` go to ``outs``; ``describe(chunk)`` names it in errors."""

    rng: ByteRange
    lay: ArrayLayout
    chunks: list
    outs: Mapping
    r0: int
    r1: int
    describe: Callable


class ReadTargets:
    """Scatter-read buffers for planned range reads, and their checking.

    For a chunk that spans the output's full width the rows a request needs are read straight into the output
    (no copy); rows before/after them land in scratch space and only feed the crc32c, computed incrementally
    over the chunk's parts in order. Other chunks (feature slices narrower than a column chunk) are read whole
    into scratch and copied.

    ``outs`` per request: site arrays: ``{site_index: (out [n, b1-b0], b0, b1)}``; others: ``{0: (out, 0, 0)}``.
    Add requests with :meth:`add`, then :meth:`read` (or :meth:`build`, ``backend.readinto_ranges`` and
    :meth:`finish`).
    """

    def __init__(self) -> None:
        self._items: list[_ReadItem] = []
        self._sizes = 0
        self.requests: list = []
        self._checks: list = []  # per request: list of (parts, crc view, chunk id) and copies

    #: requests are split into pieces of about this many bytes (whole chunks): each piece is checked as soon as
    #: it has been read, while its bytes are still in cache (1-4 MiB measured best; 256 KiB pieces cost more in
    #: per-call overhead than they gained in cache hits; checking on a second thread lost on 2 busy CPUs)
    piece_bytes = 1 << 20

    def add(self, rng: ByteRange, lay: ArrayLayout, chunks, outs: Mapping, r0: int, r1: int, describe) -> None:
        scb = lay.stored_chunk_nbytes
        per = max(1, self.piece_bytes // scb)
        if len(chunks) <= per:
            self._items.append(_ReadItem(rng, lay, chunks, outs, r0, r1, describe))
            return
        for a in range(0, len(chunks), per):
            part = chunks[a : a + per]
            sub = ByteRange(rng.key, rng.start + a * scb, rng.start + (a + len(part)) * scb)
            self._items.append(_ReadItem(sub, lay, part, outs, r0, r1, describe))

    def build(self) -> list:
        """Lay out every request's buffers (one scratch arena for all) -> ``[(ByteRange, [buffers])]``."""
        plans = []
        scratch_total = 0
        n_chunks = 0
        direct_of: dict[int, dict] = {}  # id(outs) -> {key: byte view of the output, or None (copy)}
        for item in self._items:
            lay, chunks, outs, r0, r1 = item.lay, item.chunks, item.outs, item.r0, item.r1
            cr, cb = lay.chunk_rows, lay.chunk_nbytes
            row_b = cb // cr
            grouped, n_col = lay.spec.grouped, lay.n_col
            direct = direct_of.get(id(outs))
            if direct is None:
                direct = {}
                for key, (out, b0, b1) in outs.items():
                    full = not grouped or (n_col == 1 and b0 == 0 and b1 == lay.width)
                    direct[key] = memoryview(out).cast("B") if full and out.flags.c_contiguous else None
                direct_of[id(outs)] = direct
            plan = []
            for i, f in chunks:
                c0 = i * cr
                c1 = c0 + cr
                lo = c0 if c0 > r0 else r0
                hi = c1 if c1 < r1 else r1
                dst = direct[f // n_col if grouped else 0]
                if dst is not None:  # rows [lo, hi) straight into the output, the rest of the chunk to scratch
                    head, tail = (lo - c0) * row_b, (c1 - hi) * row_b
                    plan.append((dst[(lo - r0) * row_b : (hi - r0) * row_b], head, tail, i, f))
                    scratch_total += head + tail
                else:  # the whole chunk to scratch, copied after the check
                    plan.append((None, cb, (lo, hi), i, f))
                    scratch_total += cb
            n_chunks += len(plan)
            plans.append(plan)
        arena = memoryview(_scratch(scratch_total + 4 * n_chunks))
        pos = 0
        self.requests = []
        self._checks = []
        for item, plan in zip(self._items, plans):
            bufs: list = []
            checks: list = []
            for dst, a, b, i, f in plan:
                if dst is not None:
                    if a or b:
                        parts = []
                        if a:
                            parts.append(arena[pos : pos + a])
                            pos += a
                        parts.append(dst)
                        if b:
                            parts.append(arena[pos : pos + b])
                            pos += b
                    else:
                        parts = [dst]
                    copy = None
                else:
                    parts = [arena[pos : pos + a]]
                    pos += a
                    copy = b
                crc = arena[pos : pos + 4]
                pos += 4
                bufs.extend(parts)
                bufs.append(crc)
                checks.append((parts, crc, (i, f), copy))
            self.requests.append((item.rng, bufs))
            self._checks.append(checks)
        return self.requests

    def finish(self, counts: Sequence[int]) -> None:
        """Check every chunk's crc32c, then copy the whole-chunk reads' requested rows/columns into the outputs.

        Raises:
            IntegrityError: short read or crc mismatch, message from the request's ``describe((i, f))``.
        """
        for k, nread in enumerate(counts):
            self.check(k, nread)

    def read(self, backend) -> None:
        """Build, read through ``backend.readinto_ranges`` and check every request as soon as it has been read,
        while its bytes are still in cache (pieces of ~:attr:`piece_bytes`): the copy and the checksum cost
        one pass over memory, not two.

        Raises:
            IntegrityError: as :meth:`finish` (the earliest failing request; requests after it may have been read
                by other threads, but the outputs of a failed read must not be used).
            ObjectNotFoundError, BackendError: from the backend.
        """
        backend.readinto_ranges(self.build(), done=self.check)

    def check(self, k: int, nread: int) -> None:
        """Check request ``k`` (``nread`` bytes read) and copy its whole-chunk reads into the outputs."""
        item = self._items[k]
        lay, chunks, outs, r0, describe = item.lay, item.chunks, item.outs, item.r0, item.describe
        checks = self._checks[k]
        expect = lay.stored_chunk_nbytes * len(chunks)
        if nread != expect:
            raise IntegrityError(f"short read: expected {expect} bytes, got {nread} ({describe(chunks[0])})")
        cr = lay.chunk_rows
        for parts, crc_view, (i, f), copy in checks:
            c = 0
            for part in parts:
                c = _crc32c.crc32c(part, c)
            if c != int.from_bytes(crc_view, "little"):
                raise IntegrityError(f"crc32c mismatch: {describe((i, f))}")
            if copy is None:
                continue
            lo, hi = copy
            if lay.spec.grouped:
                s, j = divmod(f, lay.n_col)
                out, b0, b1 = outs[s]
                cc = lay.col_chunk
                data = np.frombuffer(parts[0], dtype=lay.spec.dtype).reshape(cr, cc)
                clo, chi = max(b0, j * cc), min(b1, (j + 1) * cc)
                out[lo - r0 : hi - r0, clo - b0 : chi - b0] = data[lo - i * cr : hi - i * cr,
                                                                   clo - j * cc : chi - j * cc]
            else:
                data = np.frombuffer(parts[0], dtype=lay.spec.dtype).reshape(lay.chunk_shape)
                outs[0][0][lo - r0 : hi - r0] = data[lo - i * cr : hi - i * cr]


def choose_chunk_rows(rows: int, target: int) -> int:
    """Inner chunk rows for a segment of ``rows`` rows: the fewest chunks of at most ``target`` rows, sized
    evenly so that the padded tail of the last chunk is smaller than the number of chunks."""
    n = max(1, math.ceil(rows / target))
    return math.ceil(rows / n)


@functools.lru_cache(maxsize=4096)
def layout(spec: ArraySpec, rows: int, chunk_rows: int, shard_bytes: int) -> ArrayLayout:
    """Shards hold a whole number of inner-chunk rows and at most ``shard_bytes`` (at least one chunk row)."""
    n_chunks = math.ceil(rows / chunk_rows)
    per_shard = max(1, shard_bytes // max(1, chunk_rows * spec.row_nbytes))
    # max(1, ...): an array of 0 elements (a margin rows array whose rows are all empty) has 0 shards of one chunk
    return ArrayLayout(spec, rows, chunk_rows, chunk_rows * max(1, min(per_shard, n_chunks)))


def margin_layout(spec: ArraySpec, nbytes: int, chunk_rows: int, shard_bytes: int) -> ArrayLayout:
    """The layout of a margin rows array of ``nbytes`` bytes in a segment of ``chunk_rows`` (FORMAT §2.3): inner
    chunks of ``64 * chunk_rows`` bytes, shards of at most ``shard_bytes`` (at least one chunk). A reader that knows
    only that the array holds at least ``nbytes`` bytes may use it for those bytes: a chunk's shard and offset do
    not depend on the array's length (every shard but the last holds ``floor(shard_bytes / chunk bytes)`` chunks)."""
    from .keys import margin_chunk_bytes

    return layout(spec, nbytes, margin_chunk_bytes(chunk_rows), shard_bytes)


def group_metadata(attributes: Mapping) -> bytes:
    return json.dumps(
        {"zarr_format": 3, "node_type": "group", "attributes": dict(attributes)}, separators=(",", ":")
    ).encode()


def array_metadata(lay: ArrayLayout) -> bytes:
    return json.dumps(lay.zarr_metadata(), separators=(",", ":")).encode()
