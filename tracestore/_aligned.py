"""Page-aligned host buffers for the read and write paths.

The kernel's copies between the page cache and user memory (``preadv``, ``writev``) ran 2-3x slower on the
benchmark machine (AMD EPYC) when the user address sat 1-31 bytes past the file offset's position in its page;
numpy's 16-byte-aligned allocations put page-aligned chunks exactly there. Buffers are therefore placed at a
chosen offset from a page boundary.
"""

from __future__ import annotations

import numpy as np

PAGE = 4096


def aligned_view(raw: np.ndarray, nbytes: int, offset: int = 0) -> np.ndarray:
    """``nbytes`` of the uint8 array ``raw`` starting ``offset`` bytes past a page boundary (a view: its ``base`` is
    ``raw``, which needs ``nbytes + PAGE`` bytes or more)."""
    start = (offset - raw.ctypes.data) % PAGE
    return raw[start : start + nbytes]


def aligned_empty(nbytes: int, offset: int = 0) -> np.ndarray:
    """An uninitialised uint8 array of ``nbytes`` starting ``offset`` bytes past a page boundary."""
    return aligned_view(np.empty(nbytes + PAGE, np.uint8), nbytes, offset)
