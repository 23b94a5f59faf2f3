"""Random margin exceptions and damaged rows, shared by the margin-row codec tests (numpy `compact.unpack_rows`
against its row-by-row reference, the torch codec `compact_device` against numpy)."""

from __future__ import annotations

import numpy as np
import torch

from tracerl.errors import ConfigError, HintCodingError
from tracerl.hints import compact as C

CODINGS = ["bitmap", "block-bitmap", "gamma", "rice0", "rice1", "rice3", "rice5", "rice8"]


def random_exceptions(rng, t, w, p_value, p_block, payload, full_values=False, full_blocks=False):
    """`MarginExceptions` of T x W with values marked at rate ``p_value`` and blocks at ``p_block`` (every one with
    ``full_*``), random hint bits and scale bytes (LSBs with ``payload="lsb"``)."""
    vm = torch.from_numpy(rng.random((t, w)) < p_value) if not full_values else torch.ones(t, w, dtype=torch.bool)
    sm = (torch.from_numpy(rng.random((t, w // 16)) < p_block) if not full_blocks
          else torch.ones(t, w // 16, dtype=torch.bool))
    hint = torch.from_numpy(rng.integers(0, 2, int(vm.sum()), dtype=np.uint8))
    top = 2 if payload == "lsb" else 127
    scale = torch.from_numpy(rng.integers(0, top, int(sm.sum()), dtype=np.uint8))
    return C.MarginExceptions(vm, hint, sm, scale, 0.1, 0.2, payload)


def cases(seed, n):
    """``n`` (rng, exceptions, coding) of mixed widths (16..2048), row counts (0..64), densities, codings (``all``
    now and then) and payloads."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        w = int(rng.choice([16, 48, 256, 2048]))
        t = int(rng.choice([0, 1, 3, 17, 64]))
        values = CODINGS[i % len(CODINGS)] if i % 9 else "all"
        blocks = CODINGS[(3 * i + 1) % len(CODINGS)] if i % 7 else "all"
        if blocks == "block-bitmap" and (w // 16) % 16:
            blocks = "gamma"  # block-bitmap needs a multiple of 16 blocks
        p = float(rng.choice([0.0, 0.003, 0.05, 0.3, 0.9, 1.0]))
        enc = random_exceptions(rng, t, w, p, float(rng.choice([0.0, 0.1, 0.6])), ["byte", "lsb"][i % 2],
                                values == "all", blocks == "all")
        yield rng, enc, C.SiteCoding(values, blocks)


def damaged_rows(rng, packed: C.PackedRows) -> list[tuple[np.ndarray, np.ndarray]]:
    """(data, offsets) of ``packed`` damaged three ways: one bit flipped, a row cut short by a byte, a row grown by a
    random byte (the cut only when that row has a byte)."""
    damaged = []
    flip = packed.data.copy()
    bit = int(rng.integers(0, flip.size * 8))
    flip[bit // 8] ^= np.uint8(1 << (7 - bit % 8))
    damaged.append((flip, packed.offsets))
    r = int(rng.integers(0, len(packed.offsets) - 1))
    if packed.offsets[r + 1] > packed.offsets[r]:  # row r one byte shorter
        cut = np.delete(packed.data, packed.offsets[r + 1] - 1)
        damaged.append((cut, np.concatenate([packed.offsets[: r + 1], packed.offsets[r + 1:] - 1])))
    extra = np.insert(packed.data, packed.offsets[r + 1], np.uint8(rng.integers(0, 256)))  # row r one longer
    damaged.append((extra, np.concatenate([packed.offsets[: r + 1], packed.offsets[r + 1:] + 1])))
    return damaged


def coding_error(fn, *args):
    """(type, message) of the `ConfigError` / `HintCodingError` ``fn(*args)`` raises, or None: two codecs (or two
    paths of one) are compared on what they refuse and how they say it."""
    try:
        fn(*args)
    except (ConfigError, HintCodingError) as e:
        return type(e), str(e)
    return None
