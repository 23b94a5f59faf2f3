"""In-process memory backend (``memory://name``): for tests and examples; shared by all stores of a process."""

from __future__ import annotations

import threading
import time

from .base import Backend, Data, ObjectInfo, _check_key, join_parts
from ..errors import ObjectNotFoundError

_STORES: dict[str, dict[str, tuple[bytes, float]]] = {}
_LOCK = threading.Lock()


class MemoryBackend(Backend):
    def __init__(self, url: str):
        self.url = url.rstrip("/")
        with _LOCK:
            self._objects = _STORES.setdefault(self.url, {})

    def get(self, key: str) -> bytes:
        _check_key(key)
        try:
            return self._objects[key][0]
        except KeyError:
            raise ObjectNotFoundError(f"object {key!r} not found in {self.url}") from None

    def get_range(self, key: str, start: int, stop: int) -> bytes:
        return self.get(key)[start:stop]

    def put(self, key: str, data: Data) -> None:
        _check_key(key)
        with _LOCK:
            self._objects[key] = (join_parts(data), time.time())

    def put_if_absent(self, key: str, data: Data) -> bool:
        _check_key(key)
        with _LOCK:
            if key in self._objects:
                return False
            self._objects[key] = (join_parts(data), time.time())
            return True

    def exists(self, key: str) -> bool:
        return key in self._objects

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        with _LOCK:
            items = [(k, v) for k, v in self._objects.items() if k.startswith(prefix)]
        return sorted((ObjectInfo(k, len(v[0]), v[1]) for k, v in items), key=lambda o: o.key)

    def delete(self, key: str) -> None:
        with _LOCK:
            self._objects.pop(key, None)

    @staticmethod
    def clear(url: str) -> None:
        """Forget every object of ``memory://...`` store ``url`` (tests)."""
        with _LOCK:
            _STORES.pop(url.rstrip("/"), None)
