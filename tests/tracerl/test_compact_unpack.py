"""`compact.unpack_rows` (vectorized: fixed fields gathered, gamma / Rice codewords found by pointer doubling) against
the row-by-row bit parser it replaced, kept here as the reference: equal `MarginExceptions` for random rows of every
coding, width, density and payload, and a `HintCodingError` from both for the same damaged bytes (random bit flips,
cut or extended rows)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.margin import cases as _cases
from helpers.margin import damaged_rows

from tracerl.errors import HintCodingError
from tracerl.hints import compact as C


# ---- the reference: the per-row decoder of commit 20c11a0 --------------------------------------------------
class _RefBits:
    """A row's bits as a '0'/'1' string with a read position."""

    def __init__(self, data: np.ndarray, what: str):
        self.s = (np.unpackbits(data) + ord("0")).tobytes().decode("ascii")
        self.pos = 0
        self.what = what

    def read(self, n: int) -> int:
        if n == 0:
            return 0
        if self.pos + n > len(self.s):
            raise HintCodingError(f"{self.what}: truncated ({n} bits wanted at bit {self.pos} of {len(self.s)})")
        v = int(self.s[self.pos: self.pos + n], 2)
        self.pos += n
        return v

    def gamma(self) -> int:
        one = self.s.find("1", self.pos)
        if one < 0:
            raise HintCodingError(f"{self.what}: truncated Elias-gamma code at bit {self.pos}")
        zeros = one - self.pos
        self.pos = one
        return self.read(zeros + 1)

    def unary(self) -> int:
        zero = self.s.find("0", self.pos)
        if zero < 0:
            raise HintCodingError(f"{self.what}: truncated unary code at bit {self.pos}")
        q = zero - self.pos
        self.pos = zero + 1
        return q


def _ref_read_positions(b: _RefBits, coding: str, n: int) -> np.ndarray:
    k = C._check_coding(coding, n)
    if coding == "all":
        return np.arange(n, dtype=np.int64)
    if coding == "bitmap":
        return np.flatnonzero(np.array([b.read(1) for _ in range(n)], dtype=bool))
    if coding == "block-bitmap":
        present = np.flatnonzero(np.array([b.read(1) for _ in range(n // C.GROUP)], dtype=bool))
        out = []
        for grp in present:
            bits = b.read(C.GROUP)
            if bits == 0:
                raise HintCodingError(f"{b.what}: group {grp} flagged present but has no marked position")
            out.extend(grp * C.GROUP + j for j in range(C.GROUP) if bits >> (C.GROUP - 1 - j) & 1)
        return np.asarray(out, dtype=np.int64)
    count = b.gamma() - 1
    if count > n:
        raise HintCodingError(f"{b.what}: {count} positions in a row of {n}")
    pos, prev = np.empty(count, dtype=np.int64), -1
    for i in range(count):
        gap = b.gamma() if k is None else ((b.unary() << k) | b.read(k)) + 1
        prev += gap
        if prev >= n:
            raise HintCodingError(f"{b.what}: position {prev} past the row of {n}")
        pos[i] = prev
    return pos


def unpack_rows_reference(packed: C.PackedRows) -> C.MarginExceptions:
    """The row-by-row decoder `compact.unpack_rows` had before it was vectorized (kept as the reference): the inverse of `pack_rows`. Raises `HintCodingError` for bytes that do not decode as the coding says
    (truncated, positions past the row, non-zero padding or trailing bits)."""
    w = packed.width
    nb = w // C.BLOCK
    offsets = np.asarray(packed.offsets, dtype=np.int64)
    t_ = len(offsets) - 1
    if t_ < 0 or offsets[0] != 0 or offsets[-1] != packed.data.size or (np.diff(offsets) < 0).any():
        raise HintCodingError(f"row offsets {offsets[:4].tolist()}... do not cover {packed.data.size} bytes")
    vmask = np.zeros((t_, w), dtype=bool)
    smask = np.zeros((t_, nb), dtype=bool)
    hints, scales = [], []
    for r in range(t_):
        b = _RefBits(packed.data[offsets[r]: offsets[r + 1]], f"row {r}")
        vpos = _ref_read_positions(b, packed.coding.values, w)
        vmask[r, vpos] = True
        hints.extend(b.read(1) for _ in vpos)
        spos = _ref_read_positions(b, packed.coding.blocks, nb)
        smask[r, spos] = True
        scales.extend(b.read(1 if packed.scale_payload == "lsb" else 8) for _ in spos)
        rest = b.s[b.pos:]
        if len(rest) >= 8 or "1" in rest:
            raise HintCodingError(f"row {r}: {len(rest)} bits after the last field (padding must be < 8 zero bits)")
    return C.MarginExceptions(torch.from_numpy(vmask), torch.tensor(hints, dtype=torch.uint8),
                            torch.from_numpy(smask), torch.tensor(scales, dtype=torch.uint8),
                            packed.margin, packed.scale_margin, packed.scale_payload)


# ---- the tests ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
def test_vectorized_unpack_equals_the_row_by_row_reference(seed):
    for _, enc, coding in _cases(seed, 40):
        packed = C.pack_rows(enc, coding)
        got = C.unpack_rows(packed)
        assert got == unpack_rows_reference(packed) == enc, coding
        assert got.hint_bits.dtype == got.scale_bytes.dtype == torch.uint8
        assert got.value_mask.shape == enc.value_mask.shape and got.scale_mask.shape == enc.scale_mask.shape


def _outcome(fn, packed):
    try:
        return fn(packed)
    except HintCodingError:
        return HintCodingError


@pytest.mark.parametrize("seed", range(3))
def test_damaged_rows_fail_in_both_or_decode_alike(seed):
    """A flipped bit, a row cut short or grown by a byte: the reference and the vectorized decoder agree (both raise
    `HintCodingError`, or both decode the same exceptions: some flips give other valid rows)."""
    raised = 0
    for rng, enc, coding in _cases(100 + seed, 40):
        packed = C.pack_rows(enc, coding)
        if packed.data.size == 0:
            continue
        for data, offsets in damaged_rows(rng, packed):
            bad = C.PackedRows(data, offsets, packed.width, coding, 0.1, 0.2, enc.scale_payload)
            a, b = _outcome(C.unpack_rows, bad), _outcome(unpack_rows_reference, bad)
            assert (a is HintCodingError) == (b is HintCodingError), (coding, a if a is HintCodingError else b)
            if a is HintCodingError:
                raised += 1
            else:
                assert a == b
    assert raised > 20  # the damage is mostly detected


def test_no_rows_and_empty_rows():
    for coding in (C.SiteCoding("gamma", "rice2"), C.SiteCoding("block-bitmap", "bitmap")):
        for t in (0, 5):
            enc = C.MarginExceptions(torch.zeros(t, 32, dtype=torch.bool), torch.zeros(0, dtype=torch.uint8),
                                     torch.zeros(t, 2, dtype=torch.bool), torch.zeros(0, dtype=torch.uint8), 0.1, 0.2)
            packed = C.pack_rows(enc, coding)
            assert C.unpack_rows(packed) == unpack_rows_reference(packed) == enc
