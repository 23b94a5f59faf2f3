"""fsspec backend: S3 through s3fs, and read-only access to any other fsspec filesystem.

Atomic create-if-absent on S3 is a conditional ``PUT`` with ``If-None-Match: *`` (s3fs
``pipe_file(..., mode="create")``; AWS S3 since 2024, moto's server, MinIO). Filesystems without a known
atomic create (most other fsspec implementations) open read-only: ``supports_put_if_absent`` is false and
creating a writer raises :class:`~tracestore.errors.BackendError`.

fsspec's listing cache is never trusted: it is invalidated before every ``find``, ``exists`` and whole-object
GET (s3fs sizes whole-object reads through it), and after every ``find``. Tailing does not list at all (it
GETs the next log key).
"""

from __future__ import annotations

import datetime as _dt
import logging
from collections.abc import Mapping, Sequence

from .backend import Backend, ByteRange, Data, ObjectInfo, _check_key, join_parts
from .errors import BackendError, ObjectNotFoundError

log = logging.getLogger(__name__)

_CONDITIONAL_PUT_PROTOCOLS = {"s3", "s3a"}
_OBJECT_STORE_PROTOCOLS = {"s3", "s3a", "gs", "gcs", "az", "abfs", "adl", "memory", "http", "https"}


def _mtime(info: Mapping) -> float:
    for field in ("LastModified", "mtime", "last_modified", "created", "updated"):
        value = info.get(field)
        if value is None:
            continue
        if isinstance(value, _dt.datetime):
            return value.timestamp()
        if isinstance(value, (int, float)):
            return float(value)
        try:
            return _dt.datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
        except ValueError:
            continue
    return 0.0


class FsspecBackend(Backend):
    def __init__(self, fs, root: str, url: str):
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url.rstrip("/")
        protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
        self.supports_put_if_absent = bool(_CONDITIONAL_PUT_PROTOCOLS.intersection(protocols))
        # object stores have no directories; hierarchical filesystems need parents created
        self._make_dirs = not _OBJECT_STORE_PROTOCOLS.intersection(protocols)

    def _path(self, key: str) -> str:
        _check_key(key)
        return f"{self.root}/{key}"

    def _wrap(self, e: Exception, key: str) -> BackendError:
        if isinstance(e, FileNotFoundError):
            return ObjectNotFoundError(f"object {key!r} not found in {self.url}")
        return BackendError(f"{type(e).__name__} on {key!r} in {self.url}: {e}")

    def get(self, key: str) -> bytes:
        path = self._path(key)
        try:
            # s3fs sizes whole-object reads through its listing cache: drop it so a new object is found
            self.fs.invalidate_cache(path)
            return self.fs.cat_file(path)
        except (OSError, ValueError) as e:
            raise self._wrap(e, key) from e

    def get_range(self, key: str, start: int, stop: int) -> bytes:
        if stop <= start:
            return b""
        try:
            return self.fs.cat_file(self._path(key), start=start, end=stop)
        except (OSError, ValueError) as e:
            raise self._wrap(e, key) from e

    def get_ranges(self, ranges: Sequence[ByteRange]) -> list[bytes]:
        if len(ranges) <= 1:
            return [self.get_range(r.key, r.start, r.stop) for r in ranges]
        paths = [self._path(r.key) for r in ranges]
        try:
            out = self.fs.cat_ranges(
                paths, [r.start for r in ranges], [r.stop for r in ranges], on_error="return"
            )
        except (OSError, ValueError) as e:
            raise BackendError(f"range reads failed in {self.url}: {e}") from e
        for r, value in zip(ranges, out):
            if isinstance(value, BaseException):
                raise self._wrap(value, r.key) from value
        return list(out)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        paths = [self._path(k) for k in keys]
        try:
            for p in paths:
                self.fs.invalidate_cache(p)
            out = self.fs.cat(paths, on_error="return")
        except (OSError, ValueError) as e:
            raise BackendError(f"reads failed in {self.url}: {e}") from e
        if not isinstance(out, dict):  # a single path returns bytes
            out = {paths[0]: out}
        result: list[bytes | None] = []
        for key, path in zip(keys, paths):
            value = out.get(path, out.get(self.fs._strip_protocol(path)))
            if isinstance(value, FileNotFoundError) or value is None:
                result.append(None)
            elif isinstance(value, BaseException):
                raise self._wrap(value, key) from value
            else:
                result.append(value)
        return result

    def _parents(self, paths) -> None:
        if self._make_dirs:
            for parent in {p.rsplit("/", 1)[0] for p in paths}:
                self.fs.makedirs(parent, exist_ok=True)

    def put(self, key: str, data: Data) -> None:
        try:
            self._parents([self._path(key)])
            self.fs.pipe_file(self._path(key), join_parts(data))
        except (OSError, ValueError) as e:
            raise self._wrap(e, key) from e

    def put_many(self, items: Mapping[str, Data], *, atomic: bool = True) -> None:
        if len(items) <= 1:  # an object-store PUT is atomic either way
            for key, data in items.items():
                self.put(key, data)
            return
        try:
            # async filesystems (s3fs) send these concurrently
            self._parents([self._path(k) for k in items])
            self.fs.pipe({self._path(k): join_parts(v) for k, v in items.items()})
        except (OSError, ValueError) as e:
            raise BackendError(f"writing {len(items)} objects to {self.url} failed: {e}") from e

    def put_if_absent(self, key: str, data: Data) -> bool:
        if not self.supports_put_if_absent:
            raise BackendError(
                f"{self.url}: filesystem {type(self.fs).__name__} has no atomic create-if-absent; "
                f"tracestore can read from it but not commit to it (supported: local directories, S3)"
            )
        try:
            self.fs.pipe_file(self._path(key), join_parts(data), mode="create")
            return True
        except FileExistsError:
            return False
        except (OSError, ValueError) as e:
            raise self._wrap(e, key) from e

    def exists(self, key: str) -> bool:
        path = self._path(key)
        try:
            self.fs.invalidate_cache(path)
            return bool(self.fs.isfile(path))
        except (OSError, ValueError) as e:
            raise self._wrap(e, key) from e

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        base = self.root
        directory = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        path = f"{base}/{directory}" if directory else base
        try:
            self.fs.invalidate_cache(path)
            found = self.fs.find(path, detail=True)
            self.fs.invalidate_cache(path)  # leave no listing behind that later lookups could trust
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as e:
            raise BackendError(f"listing {path!r} in {self.url} failed: {e}") from e
        out = []
        for name, info in found.items():
            if info.get("type", "file") != "file":
                continue
            key = name[len(base) + 1 :] if name.startswith(base + "/") else name
            if key.startswith(prefix):
                out.append(ObjectInfo(key, int(info.get("size") or 0), _mtime(info)))
        out.sort(key=lambda o: o.key)
        return out

    def delete(self, key: str) -> None:
        try:
            self.fs.rm_file(self._path(key))
        except FileNotFoundError:
            return
        except (OSError, ValueError) as e:
            raise self._wrap(e, key) from e

    def delete_many(self, keys) -> None:
        paths = [self._path(k) for k in keys]
        if not paths:
            return
        try:
            self.fs.rm(paths)
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as e:
            raise BackendError(f"deleting {len(paths)} objects in {self.url} failed: {e}") from e
