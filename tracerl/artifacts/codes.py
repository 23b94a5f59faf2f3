"""The rollout's recorded FP4 codes beside a store: a measurement aid for the trainer's code agreement.

With ``record_codes`` the rollout worker (`tracerl.rollout.RolloutWorker`) writes one ``.npz`` object per
generation batch under the store's ``audit`` area (``codes/<batch>.npz``: ``"<traj_id>/<site>"`` -> packed codes
uint8 [tokens, W/2], the codes the rollout's forward used, at 4x the hint bytes) and names it in each
trajectory's result (``result.extra[CODES_KEY]``); the trainer reads them back (`RolloutCodes`).
"""

from __future__ import annotations

import collections
import io
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

import tracestore as ts

log = logging.getLogger(__name__)

__all__ = ["CODES_KEY", "put_codes", "RolloutCodes"]

#: the key in a result's ``extra`` that names its batch's codes object (a key below the store's URL)
CODES_KEY = "codes_key"
#: the store's application area the codes objects live in (tracestore FORMAT §2), and their prefix below the URL
AREA = "audit"
CODES_PREFIX = f"{AREA}/codes/"


def put_codes(store: ts.Store, writer_id: str, batch: int, request_ids: Sequence[str],
              codes: Mapping[str, Sequence[np.ndarray]]) -> str:
    """Write one generation batch's codes (site -> per request uint8 [tokens, W/2], in ``request_ids``' order) as
    one ``.npz`` beside the store; returns its key, to put in each result's ``extra[CODES_KEY]``. Write it before
    any result names it, so a trainer that reads a result finds the codes.

    Raises tracestore.BackendError when the storage fails."""
    arrays = {f"{rid}/{site}": per[i] for site, per in codes.items() for i, rid in enumerate(request_ids)}
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    name = f"codes/{writer_id}/{batch:06d}.npz"
    store.area(AREA).put(name, buf.getvalue())
    return f"{AREA}/{name}"


class RolloutCodes:
    """The rollout's recorded codes (`put_codes`), loaded on demand and cached for a few batches."""

    def __init__(self, store: ts.Store, keep: int = 4):
        self.store = store
        self.keep = keep
        self._cache: collections.OrderedDict[str, Any] = collections.OrderedDict()

    def get(self, traj: Any, site: str) -> np.ndarray | None:
        """uint8 [num_tokens, W/2] packed codes of trajectory ``traj`` (anything with its `tracestore.Result` as
        ``result``, e.g. a `tracerl.train.Trajectory`) at ``site``, or None when not recorded."""
        result = traj.result
        key = result.extra.get(CODES_KEY) if result is not None and isinstance(result.extra, Mapping) else None
        if not key:
            return None
        arrays = self._cache.get(key)
        if arrays is None:
            try:
                arrays = dict(np.load(io.BytesIO(self.store.area(AREA).get(key.removeprefix(f"{AREA}/")))))
            except ts.ObjectNotFoundError:
                log.warning("codes %s of %s are missing; no code agreement for it", key, result.traj_id)
                arrays = {}
            self._cache[key] = arrays
            while len(self._cache) > self.keep:
                self._cache.popitem(last=False)
        return arrays.get(f"{result.traj_id}/{site}")
