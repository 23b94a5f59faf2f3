"""Which rule made a store's codes: per policy version and writer, the quantizer settings and the scale multiplier
SGLang actually used at each hinted site, kept beside the store (torch-free; ``schemas/ARTIFACTS.md``).

Layout, in the application area ``quantizer/`` of the store's URL (tracestore's ``gc``/``verify`` leave it alone)::

    quantizer/<policy version, 12 digits>/<writer id>.json      created once with put-if-absent

One object per (policy version, writer): every SGLang server and rank that records a version writes its own, so a
store says for each trajectory (its records name their writer) which settings made its codes.

The numbers (SGLang 0.5.23, ``modelopt_quant.py``): the checkpoint's per-expert ``w13_input_scale`` is reduced to
one fp32 ``g = max(...)`` and SGLang passes ``input_scale_quant = fp32(1 / g)`` (correctly rounded) to the
quantizer, which computes its block scales and codes from that multiplier ``m``. The trainer's rule (NUMERICS
§3, §6) uses ``div_rn(1, g)``: it divides by the same numbers exactly when ``div_rn(1, g) == m``. A record keeps
``m`` (its fp32 bits) and a ``g`` with that property (the checkpoint's when known, else the nearest fp32 that has
it); `global_scales` hands the trainer that ``g``. (``fl(1 / m)`` itself is not always such a ``g``: for ~14% of
fp32 values ``fl(1 / fl(1 / g)) != g``.)
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Mapping
from typing import Any

import tracestore as ts
from tracerl.sglang.errors import QuantizerRecordError

__all__ = ["AREA", "KIND", "FORMAT_VERSION", "record_name", "make_record", "put_record", "read_records",
           "global_scales", "global_scale_for", "f32_bits", "f32_from_bits", "reciprocal_f32"]

AREA = "quantizer"
KIND = "tracerl.sglang.quantizer"
FORMAT_VERSION = 1
_DIGITS = 12


def f32_bits(x: float) -> str:
    """The fp32 bits of ``x`` (rounded to fp32) as ``0x%08x``."""
    return f"0x{struct.unpack('<I', struct.pack('<f', x))[0]:08x}"


def f32_from_bits(bits: str) -> float:
    """The fp32 value of ``0x%08x`` bits (`f32_bits`' inverse); `QuantizerRecordError` for anything else."""
    if not (isinstance(bits, str) and len(bits) == 10 and bits.startswith("0x")
            and all(c in "0123456789abcdef" for c in bits[2:])):
        raise QuantizerRecordError(f"fp32 bits must be '0x' and 8 lowercase hex digits, got {bits!r:.40}")
    v = int(bits, 16)
    return struct.unpack("<f", struct.pack("<I", v))[0]


def _f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def reciprocal_f32(x: float) -> float:
    """fp32(1 / x), correctly rounded (the double quotient rounded once more to fp32 is the correctly rounded
    fp32 quotient: double rounding is innocuous for division)."""
    return _f32(1.0 / _f32(x))


def global_scale_for(multiplier: float, preferred: float | None = None) -> float:
    """An fp32 ``g`` with ``fp32(1 / g) == multiplier`` (bit for bit): ``preferred`` when it has the property,
    else the first of fp32(1 / m) and its neighbours (up to 4 ulp) that has it.

    Raises:
        QuantizerRecordError: a multiplier that is not positive and finite, or that no fp32 reciprocal makes
            (SGLang made it some other way than ``fp32(1 / g)``).
    """
    m = _f32(multiplier)
    if not (m > 0 and m < float("inf")):
        raise QuantizerRecordError(f"scale multiplier {multiplier!r} is not a positive finite fp32")
    if preferred is not None and preferred > 0 and reciprocal_f32(preferred) == m:
        return _f32(preferred)
    base = struct.unpack("<i", struct.pack("<f", reciprocal_f32(m)))[0]
    for k in (0, -1, 1, -2, 2, -3, 3, -4, 4):
        g = struct.unpack("<f", struct.pack("<i", base + k))[0]
        if g > 0 and reciprocal_f32(g) == m:
            return g
    raise QuantizerRecordError(f"no fp32 g has fp32(1/g) == {m!r} ({f32_bits(m)}): the engine did not compute its "
                               "multiplier as fp32(1/g); the trainer's rule (NUMERICS.md §3) cannot divide by it")


def record_name(version: int, writer_id: str) -> str:
    """``<version, 12 digits>/<writer id>.json``: the record's name in the ``quantizer`` area."""
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version < 10**_DIGITS:
        raise QuantizerRecordError(f"policy version must be an int in [0, 10^{_DIGITS}), got {version!r}")
    ts.check_id(writer_id, "writer id")
    return f"{version:0{_DIGITS}d}/{writer_id}.json"


def make_record(version: int, writer_id: str, sites: Mapping[str, Mapping[str, Any]],
                quantizer: Mapping[str, Any], *, sglang_version: str | None = None) -> dict[str, Any]:
    """The record (JSON-ready) of ``writer_id`` for policy ``version``.

    ``sites``: {site: {"layer": int, "multiplier": float (fp32), "checkpoint_global_scale": float | None}}; each
    gets ``multiplier_f32`` (its bits), ``global_scale`` and ``global_scale_f32`` (`global_scale_for`).
    ``quantizer``: the settings that made the codes (backend, FP4 quantize backend, fast math, scale layout...)."""
    out_sites = {}
    for site, s in sorted(sites.items()):
        m = _f32(float(s["multiplier"]))
        g = global_scale_for(m, s.get("checkpoint_global_scale"))
        out_sites[site] = {"layer": int(s["layer"]), "multiplier": m, "multiplier_f32": f32_bits(m),
                           "global_scale": g, "global_scale_f32": f32_bits(g)}
    return {"kind": KIND, "format_version": FORMAT_VERSION, "policy_version": version, "writer_id": writer_id,
            "sglang_version": sglang_version, "created_unix": time.time(), "quantizer": dict(quantizer),
            "sites": out_sites}


def _same(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Two records say the same (everything but the creation time)."""
    return {k: v for k, v in a.items() if k != "created_unix"} == {k: v for k, v in b.items() if k != "created_unix"}


def put_record(area: ts.ObjectArea, record: Mapping[str, Any]) -> bool:
    """Create the record if absent; True if this call created it. A record already there must say the same
    (a restarted server records the same); else `QuantizerRecordError` (its multipliers changed within one
    policy version: the codes of that version were made by two rules)."""
    name = record_name(record["policy_version"], record["writer_id"])
    data = json.dumps(record, sort_keys=True).encode()
    if area.put_if_absent(name, data):
        return True
    there = _decode(area.get(name), name)
    if not _same(there, record):
        raise QuantizerRecordError(f"{area.describe(name)} says {json.dumps(there.get('sites'))[:300]}, this writer "
                                   f"now {json.dumps(record['sites'])[:300]}: policy version "
                                   f"{record['policy_version']} was quantized by two rules")
    return False


def _decode(data: bytes, name: str) -> dict[str, Any]:
    try:
        rec = json.loads(data)
    except ValueError as e:
        raise QuantizerRecordError(f"{name}: not JSON ({e})") from None
    if not isinstance(rec, dict) or rec.get("kind") != KIND:
        raise QuantizerRecordError(f"{name}: not a {KIND} record")
    if rec.get("format_version") != FORMAT_VERSION:
        raise QuantizerRecordError(f"{name}: format_version {rec.get('format_version')!r}; this code reads "
                                   f"{FORMAT_VERSION}")
    if not isinstance(rec.get("sites"), dict):
        raise QuantizerRecordError(f"{name}: no sites")
    for site, s in rec["sites"].items():
        if not isinstance(s, dict) or reciprocal_f32(f32_from_bits(s.get("global_scale_f32"))) \
                != f32_from_bits(s.get("multiplier_f32")):
            raise QuantizerRecordError(f"{name}: site {site!r}: fp32(1/global_scale) != multiplier")
    return rec


def read_records(location: str | ts.Store | ts.ObjectArea, version: int, *,
                 storage_options: Mapping | None = None) -> list[dict[str, Any]]:
    """Every writer's record of policy ``version`` (sorted by writer id; empty when there is none).

    Raises:
        QuantizerRecordError: a record that does not decode or fails its check.
        tracestore.BackendError: storage failure (never read as "no record").
    """
    prefix = record_name(version, "x").rsplit("/", 1)[0] + "/"
    if isinstance(location, ts.ObjectArea):
        return _read_all(location, prefix)
    if isinstance(location, ts.Store):
        return _read_all(location.area(AREA), prefix)
    with ts.open_area(location, AREA, storage_options=storage_options) as area:
        return _read_all(area, prefix)


def _read_all(area: ts.ObjectArea, prefix: str) -> list[dict[str, Any]]:
    names = sorted(o.key for o in area.list(prefix) if o.key.endswith(".json"))
    return [_decode(area.get(n), n) for n in names]


def global_scales(location: str | ts.Store | ts.ObjectArea, version: int, *,
                  storage_options: Mapping | None = None) -> dict[str, float]:
    """{site: g} that the trainer divides by for the trajectories of policy ``version`` written by SGLang:
    ``fp32(1 / g)`` is, bit for bit, the multiplier SGLang quantized those sites with (pass it to
    ``FP4Runtime.set_global_scales``, with any unhinted FP4 site's own scale, before recomputing them).

    Raises:
        QuantizerRecordError: no record of that version, or two writers that recorded different multipliers for
            one site (their codes of that version were made by two rules: train them apart).
        tracestore.BackendError: storage failure.
    """
    records = read_records(location, version, storage_options=storage_options)
    if not records:
        raise QuantizerRecordError(f"no quantizer record of policy version {version} (quantizer/"
                                   f"{version:0{_DIGITS}d}/): was it written by tracerl.sglang?")
    out: dict[str, float] = {}
    seen: dict[str, str] = {}
    for rec in records:
        for site, s in rec["sites"].items():
            if site in seen and seen[site] != s["multiplier_f32"]:
                raise QuantizerRecordError(f"policy version {version}, site {site!r}: writers recorded multipliers "
                                           f"{seen[site]} and {s['multiplier_f32']} ({rec['writer_id']})")
            seen[site] = s["multiplier_f32"]
            out[site] = f32_from_bits(s["global_scale_f32"])
    return out
