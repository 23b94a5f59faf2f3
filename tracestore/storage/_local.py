"""Local-directory backend (the embedded default)."""

from __future__ import annotations

import errno
import os
import stat
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .base import PARTIAL_SUFFIX, Backend, Data, ObjectInfo, _check_key
from ..errors import AccessDeniedError, BackendError, LocationError, ObjectNotFoundError


_IOV_MAX = 512


def even_runs(sizes: list[int], n: int) -> list[range]:
    """Split items of ``sizes`` bytes, in order, into at most ``n`` non-empty contiguous runs of about equal bytes."""
    total = sum(sizes)
    bounds, acc = [0], 0
    for k, size in enumerate(sizes):
        acc += size
        if len(bounds) < n and acc >= total * len(bounds) / n and k + 1 < len(sizes):
            bounds.append(k + 1)
    bounds.append(len(sizes))
    return [range(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def _advance(views: list[memoryview], n: int) -> list[memoryview]:
    """The buffers still to transfer after a vectored read/write moved ``n`` bytes: drop the full ones, trim one."""
    k = 0
    while k < len(views) and n >= len(views[k]):
        n -= len(views[k])
        k += 1
    views = views[k:]
    if n:
        views[0] = views[0][n:]
    return views


def _write_all(fd: int, data: Data) -> None:
    """Write bytes or a gather list of buffers to ``fd`` with ``os.writev`` (no user-space concatenation)."""
    parts = [data] if isinstance(data, (bytes, bytearray, memoryview)) else list(data)
    views = [memoryview(p).cast("B") if isinstance(p, memoryview) else memoryview(p) for p in parts]
    views = [v for v in views if len(v)]
    while views:
        batch = views[:_IOV_MAX]
        views = _advance(views, os.writev(fd, batch))


class LocalBackend(Backend):
    """Objects are files below ``root``; atomic writes go through ``.<name>.<uuid>.partial`` files.

    ``put`` renames the finished partial file over the target (``os.replace``); ``put_if_absent`` hard-links
    it to the target (``os.link`` fails with EEXIST if the target exists), then removes the partial file. A
    process killed in between leaves only a ``.partial`` file, which readers ignore and ``gc`` removes.
    Durability against power loss is not promised unless ``fsync=True`` (SIGKILL of a writer is covered
    either way: finished writes live in the page cache).
    """

    def __init__(self, root: str | os.PathLike, *, fsync: bool = False):
        self.root = Path(os.path.abspath(os.path.expanduser(os.fspath(root))))
        self.url = str(self.root)
        self.fsync = bool(fsync)
        self._dirs: set[str] = set()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid = 0

    #: threads that write the objects of one ``put_many(atomic=False)`` (a segment's shards) concurrently: file
    #: creation waits on filesystem metadata, so two threads overlap one file's create with another's copy
    #: (a segment write took ~20% less on the benchmark VM)
    put_threads = 2

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _path(self, key: str) -> str:
        _check_key(key)
        return os.path.join(self.url, key)

    def _wrap(self, e: OSError, key: str) -> BackendError:
        if isinstance(e, FileNotFoundError):
            return ObjectNotFoundError(f"object {key!r} not found in {self.url}")
        if isinstance(e, PermissionError):
            return AccessDeniedError(f"permission denied on {key!r} in {self.url}: {e.strerror or e}")
        if e.errno in (errno.ENOTDIR, errno.EROFS, errno.ELOOP):
            return LocationError(f"{self.url} cannot hold a store ({key!r}): {e.strerror or e}")
        return BackendError(f"I/O error on {key!r} in {self.url}: {e}")

    def _wrap_write(self, e: OSError, key: str) -> BackendError:
        """A write that fails with ENOENT/ENOTDIR could not create the object's directory: the location is bad
        (``/proc/x``, a path through a file), not a missing object."""
        if isinstance(e, (FileNotFoundError, NotADirectoryError)):
            return LocationError(f"cannot create {key!r} in {self.url}: {e.strerror or e} "
                                 f"({e.filename or self.url})")
        return self._wrap(e, key)

    def classify(self, error: BaseException, what: str) -> BackendError:
        if isinstance(error, OSError):
            return self._wrap(error, what)
        return super().classify(error, what)

    def get(self, key: str) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                return f.read()
        except OSError as e:
            raise self._wrap(e, key) from e

    def get_range(self, key: str, start: int, stop: int) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                f.seek(start)
                return f.read(max(0, stop - start))
        except OSError as e:
            raise self._wrap(e, key) from e

    #: threads that share one large ``readinto_ranges`` call (each reads and checks a contiguous run of its
    #: requests): the copy out of the page cache and the crc32c of the read pieces scale with cores (``tracestore
    #: bench`` on the 2-core VM: page-cache read ratio 0.57-0.65 on one thread, 0.88 on two). Calls of fewer than
    #: ``parallel_read_bytes`` bytes stay on the caller's thread. 1 disables it.
    read_threads = min(4, os.cpu_count() or 1)
    parallel_read_bytes = 8 << 20

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None or self._pool_pid != os.getpid():  # (a forked child has no pool threads)
            self._pool = ThreadPoolExecutor(max(self.put_threads, self.read_threads),
                                            thread_name_prefix="tracestore-io")
            self._pool_pid = os.getpid()
        return self._pool

    def readinto_ranges(self, requests, done=None) -> list[int]:
        """`Backend.readinto_ranges` with ``preadv`` straight into the buffers. A call of at least
        ``parallel_read_bytes`` is split into up to ``read_threads`` contiguous runs of about equal bytes, read (and
        handed to ``done``, which must then be safe to call from several threads for different requests)
        concurrently, the first run on the calling thread. On failure the error of the earliest failing request
        is raised (the one the one-thread path raises, typed alike); runs after it stop at their next request."""
        sizes = [r.stop - r.start for r, _ in requests]
        total = sum(sizes)
        # at least ~half the threshold per thread: small calls are not worth a handoff
        n = min(self.read_threads, len(requests), max(1, total // max(1, self.parallel_read_bytes // 2)))
        counts = [0] * len(requests)
        failed: list[tuple[int, BaseException]] = []
        if n <= 1 or total < self.parallel_read_bytes:
            self._read_run(requests, range(len(requests)), counts, done, failed)
        else:
            runs = even_runs(sizes, n)
            futures = [self._executor().submit(self._read_run, requests, ks, counts, done, failed) for ks in runs[1:]]
            self._read_run(requests, runs[0], counts, done, failed)  # this thread would only wait otherwise
            for f in futures:
                f.result()
        if failed:  # the earliest failing request, as one thread reading in order would have met it
            raise min(failed, key=lambda kf: kf[0])[1]
        return counts

    def _read_run(self, requests, ks, counts: list[int], done, failed: list) -> None:
        """Read requests ``ks`` (ascending) in order into their buffers (``counts[k]`` = bytes read), calling
        ``done(k, n)`` after each. A failure is appended to ``failed`` as (request index, typed error); a run
        stops at its first failure or at a request after one that another run has already seen fail."""
        fd = -1
        current = None
        k = -1
        try:
            for k in ks:
                if failed and k > min(kf[0] for kf in failed):
                    return
                r, bufs = requests[k]
                if r.key != current:
                    if fd >= 0:
                        os.close(fd)
                        fd = -1
                    current = r.key
                    fd = os.open(self._path(r.key), os.O_RDONLY)
                want = r.stop - r.start
                if len(bufs) <= _IOV_MAX:  # common case: one call fills every buffer
                    got = os.preadv(fd, bufs, r.start) if want > 0 else 0
                    if got == want:
                        counts[k] = got
                        if done is not None:
                            done(k, got)
                        continue
                views = [memoryview(b).cast("B") for b in bufs]
                got, offset = 0, r.start
                while views:
                    m = os.preadv(fd, views[:_IOV_MAX], offset)
                    if m <= 0:
                        break
                    got += m
                    offset += m
                    views = _advance(views, m)
                counts[k] = got
                if done is not None:
                    done(k, got)
        except BaseException as e:  # noqa: BLE001 - handed to the caller, which raises the earliest
            err = e
            if isinstance(e, OSError):
                err = self._wrap(e, current or "")
                err.__cause__ = e
            failed.append((k, err))
        finally:
            if fd >= 0:
                os.close(fd)

    def _mkdirs(self, directory: str) -> None:
        if directory not in self._dirs:
            os.makedirs(directory, exist_ok=True)
            self._dirs.add(directory)

    def _write_new(self, path: str, data: Data) -> None:
        """Create ``path`` (``O_EXCL``: it must not exist already) holding ``data``, fsync'd if :attr:`fsync`.
        Raises OSError (callers wrap it)."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _write_all(fd, data)
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    #: how often a write starts over when a directory or a temporary file it made vanished meanwhile (gc deletes
    #: empty directories below data/ and old ``.partial`` files, whatever paused this write)
    vanished_retries = 3

    def _write_new_in(self, path: str, data: Data) -> None:
        """:meth:`_write_new` in a directory that is made first (again, if it vanished since it was made)."""
        directory = os.path.dirname(path)
        for attempt in range(self.vanished_retries + 1):
            self._mkdirs(directory)
            try:
                return self._write_new(path, data)
            except FileNotFoundError:
                self._dirs.discard(directory)  # removed by gc's pruning since it was made: make it again
                if attempt == self.vanished_retries:
                    raise

    def _write_partial(self, path: str, data: Data) -> str:
        directory, name = os.path.split(path)
        tmp = os.path.join(directory, f".{name}.{uuid.uuid4().hex}{PARTIAL_SUFFIX}")
        self._write_new_in(tmp, data)
        return tmp

    def put(self, key: str, data: Data) -> None:
        path = self._path(key)
        try:
            for attempt in range(self.vanished_retries + 1):
                tmp = self._write_partial(path, data)
                try:
                    os.replace(tmp, path)
                    return
                except FileNotFoundError:  # the temporary file was deleted (gc) before the rename: write it again
                    if attempt == self.vanished_retries:
                        raise
        except OSError as e:
            raise self._wrap_write(e, key) from e

    def put_many(self, items, *, atomic: bool = True) -> None:
        """Write many objects; ``atomic=False`` writes fresh objects in place (``O_EXCL``, no rename), for
        objects nobody reads before something else (a log entry) references them."""
        if atomic:
            for key, data in items.items():
                self.put(key, data)
            return
        if self.put_threads > 1 and len(items) > 1:
            for f in [self._executor().submit(self._create, key, data) for key, data in items.items()]:
                f.result()
            return
        for key, data in items.items():
            self._create(key, data)

    def _create(self, key: str, data: Data) -> None:
        try:
            self._write_new_in(self._path(key), data)
        except OSError as e:
            raise self._wrap_write(e, key) from e

    def put_if_absent(self, key: str, data: Data) -> bool:
        path = self._path(key)
        attempt = 0
        while True:
            try:
                tmp = self._write_partial(path, data)
            except OSError as e:
                raise self._wrap_write(e, key) from e
            try:
                os.link(tmp, path)
                return True
            except FileExistsError:
                return False
            except FileNotFoundError as e:  # the temporary file was deleted (gc) before the link: write it again
                attempt += 1
                if attempt > self.vanished_retries:
                    raise self._wrap_write(e, key) from e
            except OSError as e:
                if e.errno in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
                    raise BackendError(
                        f"{self.url}: the filesystem does not support hard links, which the local backend needs "
                        f"for atomic create-if-absent: {e}"
                    ) from e
                raise self._wrap(e, key) from e
            finally:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass

    def exists(self, key: str) -> bool:
        # os.path.isfile would answer False for any error (EACCES, EIO): only ENOENT/ENOTDIR mean absent
        try:
            return stat.S_ISREG(os.stat(self._path(key)).st_mode)
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError as e:
            raise self._wrap(e, key) from e

    def list_after(self, prefix: str, start_after: str, limit: int = 1000) -> list[str]:
        # one directory read when the prefix names a directory (the log): no walk of the whole store
        if not prefix.endswith("/"):
            return super().list_after(prefix, start_after, limit)
        directory = os.path.join(self.url, prefix)
        try:
            names = os.listdir(directory)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as e:
            raise self._wrap(e, prefix) from e
        keys = sorted(k for n in names if (k := prefix + n) > start_after and os.path.isfile(os.path.join(directory, n)))
        return keys[:limit]

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        base = self.root
        out: list[ObjectInfo] = []
        # walk only the subtree that can hold the prefix
        start = base / prefix.rsplit("/", 1)[0] if "/" in prefix else base
        if not start.is_dir():
            return out
        def failed(e: OSError) -> None:  # a directory that cannot be read is an error, not an empty one
            if not isinstance(e, FileNotFoundError):
                raise self._wrap(e, os.path.relpath(e.filename or str(start), base)) from e

        for dirpath, _dirnames, filenames in os.walk(start, onerror=failed):
            for name in filenames:
                full = os.path.join(dirpath, name)
                key = os.path.relpath(full, base).replace(os.sep, "/")
                if not key.startswith(prefix):
                    continue
                try:
                    st = os.stat(full)
                except FileNotFoundError:
                    continue
                out.append(ObjectInfo(key, st.st_size, st.st_mtime))
        out.sort(key=lambda o: o.key)
        return out

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        except OSError as e:
            raise self._wrap(e, key) from e
        # prune empty directories up to the root
        parent = os.path.dirname(path)
        while parent != self.url and parent.startswith(self.url):
            try:
                os.rmdir(parent)
            except OSError:
                break
            self._dirs.discard(parent)
            parent = os.path.dirname(parent)
