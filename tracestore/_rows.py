"""What :meth:`Writer.write <tracestore.writer.Writer.write>` accepts: per-token arrays (numpy or torch, CPU or
CUDA) checked against the store's declaration — ids, token positions, dtypes, shapes, sites, MoE layers, value
ranges (FORMAT §7, "a writer MUST reject") — before anything is buffered, and turned into the buffer's columns."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from .errors import DTypeError, ShapeError, SiteEncodingError, UnknownSiteError
from .format.keys import INT64_MAX, INT64_MIN, check_id, is_int

__all__ = ["CheckedWrite", "check_write", "host_rows"]

_INT32 = np.iinfo(np.int32)
_F32_MAX = float(np.finfo(np.float32).max)


class CheckedWrite(NamedTuple):
    """A write that passed every check: ``columns`` maps buffer column names to ``(array, stored dtype)`` (for
    ``experts``: the per-layer arrays, in the store's order), ``margin`` maps each margin site to its rows
    ``(data uint8 [n], offsets int64 [T + 1])`` (host numpy, ``offsets[0] == 0``, ``offsets[T] == n``) and ``T`` is
    its number of tokens."""

    traj_id: str
    token_start: int
    policy_version: int
    columns: dict
    T: int
    margin: dict = {}


def check_write(store, traj_id: object, token_start: object, *, hints, scales, token_ids, logprobs, experts,
                policy_version: object, rows=None) -> CheckedWrite:
    """Check one write (see :meth:`~tracestore.writer.Writer.write`) against ``store``'s declaration.

    Raises:
        InvalidIdError, ShapeError, DTypeError, UnknownSiteError, SiteEncodingError (a ShapeError: hints/scales for
        a margin site, rows for a bits site): what arrived and what is allowed.
    """
    traj_id = check_id(traj_id)
    token_start, policy_version = _check_position(token_start, policy_version)
    columns, T = _check_trace(token_ids, logprobs, token_start, traj_id)
    columns.update(_check_sites(store, {} if hints is None else hints, {} if scales is None else scales, T))
    margin = _check_margin_rows(store, {} if rows is None else rows, T)
    if store.moe_layers or experts:
        columns["experts"] = _check_experts(store, experts, T)
    return CheckedWrite(traj_id, token_start, policy_version, columns, T, margin)


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def _shape(x) -> tuple[int, ...]:
    return tuple(int(d) for d in x.shape)


def _kind(x) -> str:
    """'u' (unsigned int), 'i' (signed int), 'f' (float), 'b' (bool) or other numpy kind of an array/tensor."""
    if _is_torch(x):
        import torch

        if x.dtype == torch.bool:
            return "b"
        if x.dtype.is_floating_point:
            return "f"
        if x.dtype.is_complex:
            return "c"
        return "u" if x.dtype == torch.uint8 else "i"
    return np.asarray(x).dtype.kind


def _dtype_name(x) -> str:
    return str(x.dtype)


def _as_array(x, what: str):
    if _is_torch(x) or isinstance(x, np.ndarray):
        return x
    if isinstance(x, (list, tuple)):
        return np.asarray(x)
    raise DTypeError(f"{what}: expected a numpy array or torch tensor, got {type(x).__name__}")


def _is_u8(x) -> bool:
    """Whether ``x`` (numpy array or torch tensor) is uint8, without formatting the dtype (str() is slow)."""
    dt = x.dtype
    return dt == np.uint8 if isinstance(dt, np.dtype) else str(dt) == "torch.uint8"


def _fits(x, lo: int, hi: int) -> bool:
    """Whether the integer dtype of ``x`` alone guarantees ``lo <= x <= hi`` (then no min/max pass is needed:
    uint8 experts of <= 256 experts, int32 token ids)."""
    if _is_torch(x):
        import torch

        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            return False
        info = torch.iinfo(x.dtype)
    else:
        if x.dtype.kind not in "iu":
            return False
        info = np.iinfo(x.dtype)
    return info.min >= lo and info.max <= hi


def _check_float32_range(x, what: str) -> None:
    """Finite values beyond float32's range would silently become +-inf when stored as float32: refuse them
    (NaN and +-inf pass through unchanged)."""
    if _is_torch(x):
        import torch

        if x.dtype != torch.float64:
            return
        finite = x[torch.isfinite(x)]
        big = float(finite.abs().max().item()) if finite.numel() else 0.0
    else:
        if np.asarray(x).dtype.itemsize <= 4:
            return
        a = np.asarray(x, dtype=np.float64)
        finite = a[np.isfinite(a)]
        big = float(np.abs(finite).max()) if finite.size else 0.0
    if big > _F32_MAX:
        raise DTypeError(f"{what} holds {big!r}, beyond float32's range (max {_F32_MAX:.4g}); values are stored as "
                         f"float32")


def _minmax(x) -> tuple[float, float]:
    if _is_torch(x):
        return float(x.min().item()), float(x.max().item())
    return float(np.min(x)), float(np.max(x))


def host_rows(x, s: int, e: int):
    """Rows ``[s, e)`` of ``x`` as a host numpy array (a view for numpy and CPU tensors; CUDA rows are copied)."""
    if _is_torch(x):
        import torch

        t = x[s:e].detach()
        if t.dtype in (torch.bfloat16, torch.float16):
            t = t.float()
        return t.cpu().numpy()
    return x[s:e]


def _check_position(token_start: object, policy_version: object) -> tuple[int, int]:
    """``token_start`` in ``[0, 2**63 - 1]`` and ``policy_version`` in int64, as Python ints."""
    if not is_int(token_start) or not 0 <= token_start <= INT64_MAX:
        raise ShapeError(f"token_start must be an int in [0, 2**63 - 1], got {token_start!r:.40}")
    if not is_int(policy_version):
        raise DTypeError(f"policy_version must be an int, got {type(policy_version).__name__} {policy_version!r:.40}")
    if not INT64_MIN <= policy_version <= INT64_MAX:
        raise ShapeError(f"policy_version must fit int64 [-2**63, 2**63 - 1], got {policy_version!r:.40}")
    return int(token_start), int(policy_version)


def _check_trace(token_ids, logprobs, token_start: int, traj_id: str) -> tuple[dict, int]:
    """``token_ids`` (integers in int32, ``[T]``) and ``logprobs`` (floats within float32, ``[T]``) as stage
    columns, and ``T``."""
    token_ids = _as_array(token_ids, "token_ids")
    if len(_shape(token_ids)) != 1:
        raise ShapeError(f"token_ids must be 1-D [T], got shape {_shape(token_ids)}")
    T = _shape(token_ids)[0]
    if T == 0:
        raise ShapeError(f"empty write: token_ids has 0 tokens (traj {traj_id!r}, token_start {token_start})")
    if token_start > INT64_MAX - T:
        raise ShapeError(f"tokens [{token_start}, {token_start} + {T}) end past the largest token position "
                         f"2**63 - 1 (int64)")
    if _kind(token_ids) not in "iu":
        raise DTypeError(f"token_ids must be integers, got {_dtype_name(token_ids)}")
    _check_int_range(token_ids, _INT32.min, _INT32.max, "token_ids", DTypeError)
    logprobs = _as_array(logprobs, "logprobs")
    if _shape(logprobs) != (T,):
        raise ShapeError(f"logprobs must have shape ({T},) like token_ids, got {_shape(logprobs)}")
    if _kind(logprobs) != "f":
        raise DTypeError(f"logprobs must be floating point, got {_dtype_name(logprobs)}")
    _check_float32_range(logprobs, "logprobs")
    return {"token_ids": (token_ids, np.dtype("<i4")), "logprobs": (logprobs, np.dtype("<f4"))}, T


def _check_int_range(x, lo: int, hi: int, what: str, error: type) -> None:
    if not _fits(x, lo, hi):
        a, b = _minmax(x)
        if a < lo or b > hi:
            raise error(f"{what} values must be in [{lo}, {hi}], got min {a}, max {b}")


def _check_names(given: object, declared, what: str, kind: str) -> Mapping:
    """``given`` must be a mapping with exactly the ``declared`` keys (sites or MoE layers)."""
    if not isinstance(given, Mapping):
        raise DTypeError(f"{what} must be a mapping {{{kind}: array}}, got {type(given).__name__}")
    unknown = [k for k in given if k not in declared]
    if unknown:
        raise UnknownSiteError(f"{what}: unknown {kind}(s) {unknown!r}; the store declares {list(declared)}")
    missing = [k for k in declared if k not in given]
    if missing:
        raise ShapeError(f"{what}: missing {kind}(s) {missing}; every declared {kind} is required per write")
    return given


def _check_sites(store, hints, scales, T: int) -> dict:
    """``hints`` / ``scales``: uint8 ``[T, hint_bytes]`` / ``[T, scale_bytes]`` for every declared site of hint
    encoding bits (`Site.scale_bytes`: per the site's scale encoding)."""
    columns = {}
    bits = {n: s for n, s in store.sites.items() if not s.is_margin}
    for what, given, per_site in (("hints", hints, "hint_bytes"), ("scales", scales, "scale_bytes")):
        if isinstance(given, Mapping):
            wrong = [k for k in given if k in store.margin_arrays]
            if wrong:
                raise SiteEncodingError(
                    f"{what}: site(s) {wrong!r} have hint_encoding 'margin' (one variable-length row per token): give "
                    f"them in rows={{site: (data uint8 [n], offsets int64 [T + 1])}}, not {what}=; {what}= takes "
                    f"the sites of hint_encoding 'bits': {list(bits)}")
        given = _check_names(given, bits, what, "site")
        for name, site in bits.items():
            arr = _as_array(given[name], f"{what}[{name!r}]")
            want = (T, getattr(site, per_site))
            if not _is_u8(arr):
                raise DTypeError(f"{what}[{name!r}] must be uint8, got {_dtype_name(arr)}")
            if _shape(arr) != want:
                per = ("" if what == "hints" or site.scale_encoding == "bytes" else
                       f", scale encoding lsb: ceil({site.blocks} blocks / 8) bytes of scale-byte LSBs")
                raise ShapeError(f"{what}[{name!r}] must have shape {want} (T={T}, width {site.width}, "
                                 f"block {site.block_size}{per}), got {_shape(arr)}")
            columns[f"{what}.{name}"] = (arr, np.dtype(np.uint8))
    return columns


def _host_1d(x, what: str) -> np.ndarray:
    """A 1-D numpy array or torch tensor (CPU or CUDA) as host numpy; DTypeError for anything else."""
    if _is_torch(x):
        return x.detach().cpu().numpy()
    if isinstance(x, np.ndarray):
        return x
    raise DTypeError(f"{what}: expected a numpy array or torch tensor, got {type(x).__name__}")


def _margin_pair(value, what: str):
    """``(data, offsets)`` of a margin site's rows: a 2-sequence, or an object with ``data`` and ``offsets``
    attributes (such as ``tracerl.hints.compact.PackedRows``)."""
    if hasattr(value, "data") and hasattr(value, "offsets") and not isinstance(value, np.ndarray) \
            and not _is_torch(value):
        return value.data, value.offsets
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return value[0], value[1]
    raise DTypeError(f"{what} must be a pair (data uint8 [n], offsets int64 [T + 1]) or an object with .data and "
                     f".offsets, got {type(value).__name__}")


def _check_margin_rows(store, rows, T: int) -> dict:
    """``rows``: for every declared margin site, its ``T`` rows as ``(data uint8 [n], offsets integer [T + 1])``
    with ``offsets[0] == 0``, non-decreasing, ``offsets[T] == n`` and no row longer than the site's
    ``max_row_bytes``; row t is ``data[offsets[t]:offsets[t + 1]]`` (FORMAT §2.5)."""
    margin_sites = {n: store.sites[n] for n in store.margin_arrays}
    if isinstance(rows, Mapping):
        wrong = [k for k in rows if k in store.sites and k not in margin_sites]
        if wrong:
            bits = [n for n in store.sites if n not in margin_sites]
            raise SiteEncodingError(
                f"rows: site(s) {wrong!r} have hint_encoding 'bits': give them in hints= and scales= (uint8 [T, "
                f"width/8] and [T, scale bytes]), not rows=; rows= takes the sites of hint_encoding 'margin': "
                f"{list(margin_sites)}" + ("" if margin_sites else f" (this store has none; its sites: {bits})"))
    rows = _check_names(rows, margin_sites, "rows", "site")
    out = {}
    for name, site in margin_sites.items():
        what = f"rows[{name!r}]"
        data, offsets = _margin_pair(rows[name], what)
        data, offsets = _host_1d(data, f"{what} data"), _host_1d(offsets, f"{what} offsets")
        if data.dtype != np.uint8:
            raise DTypeError(f"{what} data must be uint8, got {data.dtype}")
        if data.ndim != 1:
            raise ShapeError(f"{what} data must be 1-D [n bytes], got shape {data.shape}")
        if offsets.dtype.kind not in "iu":
            raise DTypeError(f"{what} offsets must be integers (int64), got {offsets.dtype}")
        if offsets.shape != (T + 1,):
            raise ShapeError(f"{what} offsets must have shape ({T + 1},) (T + 1 for T={T} tokens: row t is "
                             f"data[offsets[t]:offsets[t + 1]]), got {offsets.shape}")
        if offsets.dtype.kind == "u" and int(offsets.max()) > INT64_MAX:
            raise ShapeError(f"{what} offsets must be in [0, {data.size}], got max {int(offsets.max())}")
        off = offsets.astype(np.int64, copy=False)
        lengths = np.diff(off)
        if off[0] != 0 or off[-1] != data.size:
            raise ShapeError(f"{what} offsets must start at 0 and end at the data's size {data.size}, got "
                             f"offsets[0] = {int(off[0])}, offsets[{T}] = {int(off[-1])}")
        if (lengths < 0).any():
            t = int(np.flatnonzero(lengths < 0)[0])
            raise ShapeError(f"{what} offsets must be non-decreasing, got offsets[{t}] = {int(off[t])} > "
                             f"offsets[{t + 1}] = {int(off[t + 1])}")
        longest = int(lengths.max()) if T else 0
        if longest > site.max_row_bytes:
            t = int(np.argmax(lengths))
            raise ShapeError(f"{what}: row {t} has {longest} bytes; site {name!r} allows at most max_row_bytes = "
                             f"{site.max_row_bytes} per row")
        out[name] = (np.ascontiguousarray(data), np.ascontiguousarray(off))
    return out


def _check_experts(store, experts, T: int) -> tuple[list, np.dtype]:
    """``experts``: integers ``[T, top_k]`` in ``[0, num_experts)`` for every declared MoE layer."""
    if not store.moe_layers:
        raise UnknownSiteError(f"experts given for {list(experts)!r} but the store declares no MoE layers")
    if not isinstance(experts, Mapping):
        raise ShapeError(f"experts {{layer: [T, {store.top_k}]}} are required: the store declares MoE "
                         f"layers {list(store.moe_layers)}; got {type(experts).__name__}")
    experts = _check_names(experts, store.moe_layers, "experts", "MoE layer")
    layer_arrays = []
    for name in store.moe_layers:
        arr = _as_array(experts[name], f"experts[{name!r}]")
        if _shape(arr) != (T, store.top_k):
            raise ShapeError(f"experts[{name!r}] must have shape ({T}, {store.top_k}), got {_shape(arr)}")
        if _kind(arr) not in "iu":
            raise DTypeError(f"experts[{name!r}] must be integers, got {_dtype_name(arr)}")
        _check_int_range(arr, 0, store.num_experts - 1, f"experts[{name!r}]", ShapeError)
        layer_arrays.append(arr)
    return layer_arrays, store.row_columns["experts"][0]
