"""The manifest ``tracestore.json`` (FORMAT §2.2): the site declaration, value checks, and the arrays every
segment holds (FORMAT §2.3)."""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from ..errors import DeclarationError, IntegrityError, SchemaVersionError, ShapeError, TraceStoreError
from .keys import (
    CODING_GROUP,
    DEFAULT_CHUNK_ROWS,
    DEFAULT_GC_GRACE_S,
    DEFAULT_HINT_ENCODING,
    DEFAULT_MAX_ROW_BYTES,
    DEFAULT_SCALE_ENCODING,
    DEFAULT_SHARD_BYTES,
    FORMAT_NAME,
    FORMAT_VERSION,
    FP4_FORMATS,
    HINT_ENCODING_SINCE,
    HINT_ENCODINGS,
    MARGIN_KEYS,
    MARGIN_OPTIONAL_KEYS,
    MAX_ROW_BYTES_LIMIT,
    POSITION_CODINGS,
    SCALE_ENCODING_SINCE,
    SCALE_ENCODINGS,
    SCALE_PAYLOADS,
    SITE_KINDS,
    check_name,
    check_version,
    is_position_coding,
)
from .segment import ArraySpec

__all__ = ["Site", "required_version", "check_manifest", "check_gc_grace", "new_manifest", "decode_manifest",
           "array_specs", "experts_dtype", "declaration"]


_SITE_KEYS = ("name", "width", "kind", "fp4_format", "block_size", "scale_encoding", "hint_encoding",
              *MARGIN_KEYS, *MARGIN_OPTIONAL_KEYS)


def _margin_value(value: object, name: str, what: str) -> float:
    """A margin as a float: a JSON number >= 0 or the string ``"inf"`` (JSON has no infinity); also math.inf."""
    if value == "inf" and isinstance(value, str):
        return math.inf
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) or not value >= 0:
        raise DeclarationError(f"site {name!r}: {what} must be a number >= 0 or \"inf\", got {value!r:.80}")
    return float(value)


@dataclass(frozen=True)
class Site:
    """A quantization site: ``width`` FP4 values per token, in blocks of ``block_size`` sharing one scale byte.

    Per token a site with ``hint_encoding="bits"`` (the default) keeps ``hint_bytes = width // 8`` hint bytes (bit i
    = LSB of the E2M1 code of value i, LSB-first) and ``scale_bytes`` scale bytes: with ``scale_encoding="bytes"``
    (the default) the ``width // block_size`` scale bytes themselves (E4M3 for nvfp4, E8M0 for mxfp4); with ``"lsb"``
    (nvfp4 only, format version 4) only each block's scale-byte LSB, 8 blocks per byte LSB-first:
    ``ceil(width / block_size / 8)`` bytes (FORMAT §2.4; the trainer works out the rest of each byte from its own
    activations).

    A site with ``hint_encoding="margin"`` (nvfp4, block 16, format version 5, FORMAT §2.5) keeps instead one
    variable-length **margin-exception row** per token, opaque bytes of at most ``max_row_bytes`` (default 65,536)
    that ``tracerl.hints.compact`` writes and reads; the codec keys ``margin`` / ``scale_margin`` (numbers >= 0 or
    ``math.inf``; ``"inf"`` in JSON), ``value_coding`` / ``block_coding`` (`POSITION_CODINGS`) and ``scale_payload``
    (``byte`` / ``lsb``) are required: the store keeps them for the reader, it does not interpret them.

    Raises:
        InvalidIdError: bad name. ShapeError: width not a positive multiple of 8 and of ``block_size``.
        DeclarationError (a ValueError): unknown ``kind``, ``fp4_format``, ``scale_encoding`` or ``hint_encoding``;
        ``"lsb"`` on a site that is not nvfp4 with block 16; a margin site that is not nvfp4 block 16, has scale
        encoding ``lsb``, misses a codec key or has one out of range; codec keys on a bits site.
    """

    name: str
    width: int
    kind: str = "activation"
    fp4_format: str = "nvfp4"
    block_size: int | None = None
    scale_encoding: str = DEFAULT_SCALE_ENCODING
    hint_encoding: str = DEFAULT_HINT_ENCODING
    margin: float | None = None
    scale_margin: float | None = None
    value_coding: str | None = None
    block_coding: str | None = None
    scale_payload: str | None = None
    max_row_bytes: int | None = None

    def __post_init__(self) -> None:
        check_name(self.name, "site name")
        if not isinstance(self.fp4_format, str) or self.fp4_format not in FP4_FORMATS:
            raise DeclarationError(f"site {self.name!r}: fp4_format {self.fp4_format!r} is not one of "
                                   f"{sorted(FP4_FORMATS)}")
        if not isinstance(self.kind, str) or self.kind not in SITE_KINDS:
            raise DeclarationError(f"site {self.name!r}: kind {self.kind!r} is not one of {list(SITE_KINDS)}")
        if not isinstance(self.scale_encoding, str) or self.scale_encoding not in SCALE_ENCODINGS:
            raise DeclarationError(f"site {self.name!r}: scale_encoding {self.scale_encoding!r:.80} is not one of "
                                   f"{list(SCALE_ENCODINGS)}")
        if not isinstance(self.hint_encoding, str) or self.hint_encoding not in HINT_ENCODINGS:
            raise DeclarationError(f"site {self.name!r}: hint_encoding {self.hint_encoding!r:.80} is not one of "
                                   f"{list(HINT_ENCODINGS)}")
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
        if self.scale_encoding == "lsb" and (self.fp4_format != "nvfp4" or self.block_size != FP4_FORMATS["nvfp4"]):
            raise DeclarationError(
                f"site {self.name!r}: scale_encoding 'lsb' (scale hints) is defined for nvfp4 sites with block "
                f"{FP4_FORMATS['nvfp4']} (E4M3 scales); this site is {self.fp4_format} with block {self.block_size}: "
                "use scale_encoding 'bytes'")
        if self.is_margin:
            self._check_margin_keys()
        else:
            given = [k for k in (*MARGIN_KEYS, *MARGIN_OPTIONAL_KEYS) if getattr(self, k) is not None]
            if given:
                raise DeclarationError(f"site {self.name!r}: {given} are codec keys of hint_encoding 'margin'; this "
                                       f"site has hint_encoding 'bits'")

    def _check_margin_keys(self) -> None:
        name = self.name
        if self.fp4_format != "nvfp4" or self.block_size != FP4_FORMATS["nvfp4"] or self.scale_encoding != "bytes":
            raise DeclarationError(
                f"site {name!r}: hint_encoding 'margin' is defined for nvfp4 sites with block {FP4_FORMATS['nvfp4']} "
                f"and scale_encoding 'bytes' (scale hints go in scale_payload 'lsb'); this site is {self.fp4_format} "
                f"with block {self.block_size} and scale_encoding {self.scale_encoding!r}")
        missing = [k for k in MARGIN_KEYS if getattr(self, k) is None]
        if missing:
            raise DeclarationError(f"site {name!r}: hint_encoding 'margin' needs the codec keys {list(MARGIN_KEYS)}; "
                                   f"missing {missing}")
        object.__setattr__(self, "margin", _margin_value(self.margin, name, "margin"))
        object.__setattr__(self, "scale_margin", _margin_value(self.scale_margin, name, "scale_margin"))
        for key, n in (("value_coding", self.width), ("block_coding", self.blocks)):
            coding = getattr(self, key)
            if not is_position_coding(coding):
                raise DeclarationError(f"site {name!r}: {key} {coding!r:.80} is not one of {list(POSITION_CODINGS)} "
                                       f"(k in 0..30)")
            if coding == "block-bitmap" and n % CODING_GROUP:
                raise DeclarationError(f"site {name!r}: {key} 'block-bitmap' needs rows of a multiple of "
                                       f"{CODING_GROUP} positions; this site's rows have {n}")
        if not isinstance(self.scale_payload, str) or self.scale_payload not in SCALE_PAYLOADS:
            raise DeclarationError(f"site {name!r}: scale_payload {self.scale_payload!r:.80} is not one of "
                                   f"{list(SCALE_PAYLOADS)}")
        cap = DEFAULT_MAX_ROW_BYTES if self.max_row_bytes is None else self.max_row_bytes
        if isinstance(cap, bool) or not isinstance(cap, (int, np.integer)) or not 1 <= cap <= MAX_ROW_BYTES_LIMIT:
            raise DeclarationError(f"site {name!r}: max_row_bytes must be an integer in [1, {MAX_ROW_BYTES_LIMIT}], "
                                   f"got {cap!r:.80}")
        object.__setattr__(self, "max_row_bytes", int(cap))

    @property
    def is_margin(self) -> bool:
        """Whether the site stores margin-exception rows (``hint_encoding == "margin"``) instead of hints/scales."""
        return self.hint_encoding == "margin"

    @property
    def hint_bytes(self) -> int:
        return self.width // 8

    @property
    def blocks(self) -> int:
        """Blocks (scales) per token: ``width // block_size``."""
        return self.width // self.block_size

    @property
    def scale_values_per_byte(self) -> int:
        """Values whose scales one stored scale byte covers: ``block_size`` (bytes), ``8 * block_size`` (lsb)."""
        return self.block_size * (8 if self.scale_encoding == "lsb" else 1)

    @property
    def scale_bytes(self) -> int:
        """Stored scale bytes per token: ``blocks`` (bytes) or ``ceil(blocks / 8)`` (lsb)."""
        return -(-self.width // self.scale_values_per_byte)

    @property
    def bytes_per_token(self) -> int:
        """Fixed payload bytes per token: hint + scale bytes; for a margin site 4 (its row end, uint32), the rows
        themselves vary."""
        return 4 if self.is_margin else self.hint_bytes + self.scale_bytes

    def to_dict(self, format_version: int = FORMAT_VERSION) -> dict:
        """The site as a manifest object of ``format_version``: every key spelled out; ``scale_encoding`` only from
        version 4, ``hint_encoding`` only from version 5 (older manifests have no such keys, and this site must use
        the defaults there); the codec keys only on margin sites (margins of ``inf`` as the string ``"inf"``).

        Raises DeclarationError: a non-default scale or hint encoding asked for in a version that lacks it."""
        d = asdict(self)
        if format_version < SCALE_ENCODING_SINCE:
            if self.scale_encoding != DEFAULT_SCALE_ENCODING:
                raise DeclarationError(f"site {self.name!r}: scale_encoding {self.scale_encoding!r} needs format "
                                       f"version >= {SCALE_ENCODING_SINCE}; the store is version {format_version}")
            del d["scale_encoding"]
        if format_version < HINT_ENCODING_SINCE:
            if self.is_margin:
                raise DeclarationError(f"site {self.name!r}: hint_encoding {self.hint_encoding!r} needs format "
                                       f"version >= {HINT_ENCODING_SINCE}; the store is version {format_version}")
            del d["hint_encoding"]
        if not self.is_margin:
            for k in (*MARGIN_KEYS, *MARGIN_OPTIONAL_KEYS):
                del d[k]
        else:
            for k in ("margin", "scale_margin"):
                d[k] = "inf" if math.isinf(d[k]) else d[k]
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> Site:
        """Raises DeclarationError (not a mapping, unknown keys, missing name/width) or as the constructor."""
        if not isinstance(d, Mapping):
            raise DeclarationError(f"a site must be a mapping with name and width, got {type(d).__name__} {d!r:.80}")
        unknown = sorted(set(d) - set(_SITE_KEYS))
        if unknown or "name" not in d or "width" not in d:
            raise DeclarationError(f"site {d!r:.120}: needs 'name' and 'width' and may have "
                                   f"{', '.join(repr(k) for k in _SITE_KEYS[2:])}"
                                   + (f"; unknown keys {unknown}" if unknown else ""))
        return cls(
            name=d["name"], width=d["width"], kind=d.get("kind", "activation"),
            fp4_format=d.get("fp4_format", "nvfp4"), block_size=d.get("block_size"),
            scale_encoding=d.get("scale_encoding", DEFAULT_SCALE_ENCODING),
            hint_encoding=d.get("hint_encoding", DEFAULT_HINT_ENCODING),
            **{k: d.get(k) for k in (*MARGIN_KEYS, *MARGIN_OPTIONAL_KEYS)},
        )


def required_version(sites: Sequence[Site], base: int) -> int:
    """The lowest format version that holds ``sites``: ``base``, 4 when a site's scale encoding is not bytes, 5 when
    a site's hint encoding is margin."""
    if any(s.is_margin for s in sites):
        return max(base, HINT_ENCODING_SINCE)
    if any(s.scale_encoding != DEFAULT_SCALE_ENCODING for s in sites):
        return max(base, SCALE_ENCODING_SINCE)
    return base


def array_specs(sites: Sequence[Site], moe_layers: Sequence[str], top_k: int, num_experts: int,
                 feature_chunk: int) -> list[ArraySpec]:
    """The arrays of every segment: sites of equal (width, block size, scale encoding) share one hints and one
    scales array ``hints.w<width>.b<block>`` / ``scales.w<width>.b<block>`` ``[rows, n_sites, bytes]`` (with
    ``.lsb`` appended for scale encoding lsb; declaration order along axis 1), then per margin site (declaration order)
    ``margin_ends.<site>`` ``[rows]`` uint32 and ``margin.<site>`` ``[nbytes]`` uint8, then ``token_ids`` ``[rows]``
    int32, ``logprobs`` ``[rows]`` float32 and, with MoE layers, ``experts`` ``[rows, L, top_k]`` uint8 (uint16
    above 256 experts)."""
    groups: dict[tuple[int, int, str], list[Site]] = {}
    for s in sites:
        if not s.is_margin:
            groups.setdefault((s.width, s.block_size, s.scale_encoding), []).append(s)
    specs = []
    for (width, block, encoding), members in groups.items():
        per_scale = members[0].scale_values_per_byte
        fc = feature_chunk if (feature_chunk and width % feature_chunk == 0 and feature_chunk % per_scale == 0
                               and feature_chunk % 8 == 0) else 0
        names = tuple(m.name for m in members)
        suffix = f"w{width}.b{block}" + ("" if encoding == DEFAULT_SCALE_ENCODING else f".{encoding}")
        specs.append(ArraySpec(f"hints.{suffix}", np.dtype(np.uint8), (len(members), width // 8), names,
                               fc // 8 if fc else 0))
        specs.append(ArraySpec(f"scales.{suffix}", np.dtype(np.uint8), (len(members), members[0].scale_bytes), names,
                               fc // per_scale if fc else 0))
    for s in sites:
        if s.is_margin:  # FORMAT §2.3: row ends [rows] uint32, then the rows back to back [nbytes] uint8
            specs.append(ArraySpec(f"margin_ends.{s.name}", np.dtype("<u4"), ()))
            specs.append(ArraySpec(f"margin.{s.name}", np.dtype(np.uint8), (), ends=f"margin_ends.{s.name}"))
    specs.append(ArraySpec("token_ids", np.dtype("<i4"), ()))
    specs.append(ArraySpec("logprobs", np.dtype("<f4"), ()))
    if moe_layers:
        specs.append(ArraySpec("experts", experts_dtype(num_experts), (len(moe_layers), top_k)))
    return specs


def experts_dtype(num_experts: int) -> np.dtype:
    return np.dtype(np.uint8) if num_experts <= 256 else np.dtype("<u2")


def new_manifest(sites: Sequence[Site], model: Mapping | None, moe_layers: Sequence[str], top_k: int, num_experts: int,
                 chunk_rows: int, shard_bytes: int, feature_chunk: int, gc_grace_s: float,
                 format_version: int = FORMAT_VERSION) -> dict:
    return {
        "format": FORMAT_NAME,
        "format_version": format_version,
        "store_id": uuid.uuid4().hex,
        "created_unix": time.time(),
        "sites": [s.to_dict(format_version) for s in sites],
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
    check_version(m.get("format_version"), "the manifest")
    store_id = m.get("store_id")
    if not isinstance(store_id, str) or not _STORE_ID_RE.fullmatch(store_id):
        raise DeclarationError(f"store_id must be 1-64 letters/digits, got {store_id!r:.80}")
    sites = m.get("sites")
    if not isinstance(sites, list) or not sites:
        raise DeclarationError(f"sites must be a non-empty list, got {sites!r:.80}")
    version = m["format_version"]
    for d in sites:  # keys of a later version first: what the site would mean there does not matter here
        if not isinstance(d, Mapping) or "name" not in d:
            continue
        if version < SCALE_ENCODING_SINCE and "scale_encoding" in d:
            raise DeclarationError(f"site {d['name']!r}: key scale_encoding is a format-version-"
                                   f"{SCALE_ENCODING_SINCE} key; this manifest declares version {version}")
        newer = [k for k in ("hint_encoding", *MARGIN_KEYS, *MARGIN_OPTIONAL_KEYS) if k in d]
        if version < HINT_ENCODING_SINCE and newer:
            raise DeclarationError(f"site {d['name']!r}: key(s) {newer} are format-version-{HINT_ENCODING_SINCE} "
                                   f"keys; this manifest declares version {version}")
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


def decode_manifest(raw: bytes, where: str) -> dict:
    """The manifest stored at ``where`` (its URL and key, named in errors), checked as :func:`check_manifest` does,
    after its JSON and its ``format`` name.

    Raises:
        SchemaVersionError: an unsupported ``format_version``. IntegrityError: not JSON, not a tracestore manifest,
        or a value of the wrong type or out of range.
    """
    try:
        manifest = json.loads(raw)
    except ValueError as e:
        raise IntegrityError(f"{where} is not valid JSON: {e}") from e
    name = manifest.get("format") if isinstance(manifest, dict) else None
    if name != FORMAT_NAME:
        raise IntegrityError(f"{where} is not a tracestore manifest (format={name!r})")
    try:
        check_manifest(manifest)
    except SchemaVersionError:
        raise
    except TraceStoreError as e:
        raise IntegrityError(f"{where}: {e}") from e
    return manifest


def declaration(m: Mapping) -> tuple:
    """What two manifests must share to be one store's declaration: the sites (compared as `Site` values, so a
    default spelled out equals one left out), MoE layers, ``top_k``, ``num_experts``."""
    return ([Site.from_dict(d) for d in m["sites"]], m.get("moe_layers", []), m.get("top_k", 0),
            m.get("num_experts", 0))
