"""Bit packing of E2M1 codes and hint bits (pure torch; CPU and GPU).

Byte layouts (normative, see NUMERICS.md):

- codes: two 4-bit codes per byte, element ``2i`` in the low nibble and ``2i+1`` in the high nibble::

      byte[i] = (code[2i] & 0xF) | (code[2i+1] << 4)        # codes_u8: [..., D] -> packed [..., D/2]

- hints: one bit per value (the LSB of its code), 8 per byte, little-endian bit order::

      byte[j] = sum_b bit[8j+b] << b                        # bits: [..., D] -> packed [..., D/8]
"""

from __future__ import annotations

import torch

from .constants import CODES_PER_BYTE, HINTS_PER_BYTE
from .errors import DTypeError, ShapeError

_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _check_int(t: torch.Tensor, name: str, allow_bool: bool = False) -> None:
    ok = t.dtype in _INT_DTYPES or (allow_bool and t.dtype == torch.bool)
    if not ok:
        allowed = "bool or integer" if allow_bool else "integer (uint8 preferred)"
        raise DTypeError(f"{name} must be {allowed}; got {t.dtype}")


def _check_last(t: torch.Tensor, name: str, multiple: int = 1) -> None:
    """At least one dimension, the last a multiple of `multiple`."""
    if t.dim() == 0 or t.shape[-1] % multiple != 0:
        want = "at least one dimension" if multiple == 1 else f"a last dimension that is a multiple of {multiple}"
        raise ShapeError(f"{name} must have {want}; got shape {tuple(t.shape)}")


def pack_codes(codes_u8: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes ``[..., D]`` (values 0..15) into bytes ``[..., D/2]`` (element 2i in the low nibble)."""
    _check_int(codes_u8, "codes")
    _check_last(codes_u8, "codes", CODES_PER_BYTE)
    c = codes_u8.to(torch.uint8) & 0xF
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_codes(codes_packed: torch.Tensor) -> torch.Tensor:
    """Unpack bytes ``[..., D/2]`` into 4-bit codes ``[..., D]`` (uint8, values 0..15)."""
    _check_int(codes_packed, "codes_packed")
    _check_last(codes_packed, "codes_packed")
    p = codes_packed.to(torch.uint8)
    out = torch.stack((p & 0xF, p >> 4), dim=-1)  # [..., D/2, 2]
    return out.reshape(*p.shape[:-1], p.shape[-1] * CODES_PER_BYTE)


def pack_hints(bits: torch.Tensor) -> torch.Tensor:
    """Pack one bit per value ``[..., D]`` (bool or 0/1 integers; only bit 0 is used) into ``[..., D/8]``
    bytes, value ``8j+b`` -> bit ``b`` of byte ``j``."""
    _check_int(bits, "hint bits", allow_bool=True)
    _check_last(bits, "hint bits", HINTS_PER_BYTE)
    b = (bits.to(torch.uint8) & 1).reshape(*bits.shape[:-1], bits.shape[-1] // HINTS_PER_BYTE, HINTS_PER_BYTE)
    # shifts made on the device (torch.tensor(..., device=cuda) would be a blocking host -> device copy)
    shifts = torch.arange(HINTS_PER_BYTE, dtype=torch.uint8, device=b.device)
    return (b << shifts).sum(dim=-1).to(torch.uint8)  # disjoint bits: sum == or


def unpack_hints(hints_packed: torch.Tensor) -> torch.Tensor:
    """Unpack hint bytes ``[..., D/8]`` into bits ``[..., D]`` (uint8 0/1)."""
    _check_int(hints_packed, "hints_packed")
    _check_last(hints_packed, "hints_packed")
    p = hints_packed.to(torch.uint8)
    shifts = torch.arange(HINTS_PER_BYTE, dtype=torch.uint8, device=p.device)
    out = (p.unsqueeze(-1) >> shifts) & 1  # [..., D/8, 8]
    return out.reshape(*p.shape[:-1], p.shape[-1] * HINTS_PER_BYTE)


def hints_from_codes(codes_packed: torch.Tensor) -> torch.Tensor:
    """Hint bytes ``[..., D/8]`` from packed codes ``[..., D/2]``: the LSB of every code, packed."""
    return pack_hints(unpack_codes(codes_packed) & 1)
