"""The rollout's recorded FP4 codes beside a store: a measurement aid for the trainer's code agreement.

With ``record_codes`` the rollout worker (`tracerl.rollout.RolloutWorker`) writes one object per generation batch
under the store's ``audit`` area (``codes/<writer>/<batch>.safetensors``: ``"<traj_id>/<site>"`` -> packed codes
uint8 [tokens, W/2], the codes the rollout's forward used, at 4x the hint bytes; stores written before 2026-12 hold
``.npz`` objects of the same arrays, read the same way) and names it in each trajectory's result
(``result.extra[CODES_KEY]``); the trainer reads them back (`RolloutCodes`), ahead of the step that needs them
(`RolloutCodes.prefetch`) so that loading them is not on the step's hot path.
"""

from __future__ import annotations

import collections
import concurrent.futures
import io
import logging
import threading
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import safetensors
import safetensors.numpy

import tracestore as ts
from tracerl.artifacts.tensorfile import decode_numpy

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
    one safetensors object beside the store; returns its key, to put in each result's ``extra[CODES_KEY]``. Write
    it before any result names it, so a trainer that reads a result finds the codes.

    Raises tracestore.BackendError when the storage fails."""
    arrays = {f"{rid}/{site}": np.ascontiguousarray(per[i], dtype=np.uint8)
              for site, per in codes.items() for i, rid in enumerate(request_ids)}
    name = f"codes/{writer_id}/{batch:06d}.safetensors"
    store.area(AREA).put(name, safetensors.numpy.save(arrays, metadata={"format": "tracerl-codes-1"}))
    return f"{AREA}/{name}"


def _decode(key: str, data: bytes) -> dict[str, np.ndarray]:
    """The arrays of one codes object (safetensors, or the ``.npz`` of stores written before 2026-12): read-only
    views of ``data`` (`tensorfile.decode_numpy`; the library's loader copied every array holding the GIL, which
    stalled the trainer's host-bound forward by ~1.7 ms per MoE layer while a prefetch ran beside it)."""
    if key.endswith(".npz"):
        with np.load(io.BytesIO(data)) as z:
            return {k: z[k] for k in z.files}
    return decode_numpy(data)[0]


class RolloutCodes:
    """The rollout's recorded codes (`put_codes`), loaded on demand or ahead (`prefetch`, in a background thread)
    and cached for the batches of the last prefetch (at least ``keep``).

    A missing or unreadable object, or a result whose ``extra[CODES_KEY]`` does not name one (not a string below
    ``audit/codes/``, or a name the store refuses), only removes the code-agreement measurement of its trajectories
    (logged once per object); a storage failure (tracestore.BackendError) is raised where its codes are asked for,
    and the object is read again when asked again."""

    def __init__(self, store: ts.Store, keep: int = 4):
        self.store = store
        self.keep = keep
        self._cache: collections.OrderedDict[str, concurrent.futures.Future] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    @staticmethod
    def _key(traj: Any) -> str | None:
        """The codes key ``traj``'s result names (``repr`` of a value that is not a string, which `_load` refuses),
        or None when it names none."""
        result = traj.result
        key = result.extra.get(CODES_KEY) if result is not None and isinstance(result.extra, Mapping) else None
        return key if key is None or isinstance(key, str) else repr(key)

    def _load(self, key: str) -> dict[str, np.ndarray]:
        if not key.startswith(CODES_PREFIX):
            log.warning("codes key %.120r is not below %s; no code agreement for its trajectories", key, CODES_PREFIX)
            return {}
        try:
            data = self.store.area(AREA).get(key.removeprefix(f"{AREA}/"))
        except ts.ObjectNotFoundError:
            log.warning("codes %s are missing; no code agreement for its trajectories", key)
            return {}
        except ts.InvalidIdError as e:
            log.warning("codes key %.120r is not an object name (%s); no code agreement for its trajectories", key, e)
            return {}
        try:
            return _decode(key, data)
        except (ValueError, OSError, EOFError, KeyError, zipfile.BadZipFile, safetensors.SafetensorError) as e:
            # (SafetensorsFormatError is a ValueError)
            log.warning("codes %s are unreadable (%s: %s); no code agreement for its trajectories", key,
                        type(e).__name__, e)
            return {}

    def _future(self, key: str, background: bool) -> concurrent.futures.Future:
        """The (cached) load of ``key``: submitted to the background thread, or run here."""
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                return fut
            if background:
                if self._pool is None:
                    self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tracerl-codes")
                fut = self._pool.submit(self._load, key)
            else:
                fut = concurrent.futures.Future()
            self._cache[key] = fut
            while len(self._cache) > self.keep:
                self._cache.popitem(last=False)
        if not background:
            try:
                fut.set_result(self._load(key))
            except BaseException as e:  # raised by `get`, which forgets the load: asked again, read again
                fut.set_exception(e)
        return fut

    def prefetch(self, trajs: Iterable[Any]) -> None:
        """Start loading, in a background thread, the codes objects ``trajs`` (objects with their
        `tracestore.Result` as ``result``) name; they stay cached at least until the next prefetch."""
        keys = list(dict.fromkeys(k for k in map(self._key, trajs) if k))
        self.keep = max(self.keep, len(keys))
        for k in keys:
            self._future(k, True)

    def get(self, traj: Any, site: str) -> np.ndarray | None:
        """uint8 [num_tokens, W/2] packed codes of trajectory ``traj`` (anything with its `tracestore.Result` as
        ``result``, e.g. a `tracerl.train.Trajectory`) at ``site``, or None when not recorded. Waits for a
        prefetch of its object; raises tracestore.BackendError when the storage fails."""
        key = self._key(traj)
        if not key:
            return None
        fut = self._future(key, False)
        try:
            arrays = fut.result()
        except BaseException:  # a storage failure is not remembered
            with self._lock:
                if self._cache.get(key) is fut:
                    del self._cache[key]
            raise
        return arrays.get(f"{traj.result.traj_id}/{site}")

    def close(self) -> None:
        """Stop the background thread (pending loads finish first)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
