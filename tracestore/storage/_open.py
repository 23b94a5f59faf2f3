"""URL -> storage backend: the one place that knows which implementation serves which URL."""

from __future__ import annotations

from collections.abc import Mapping

from ..errors import BackendError
from ._fsspec import FsspecBackend
from ._local import LocalBackend
from ._memory import MemoryBackend
from .base import Backend, RetryPolicy

__all__ = ["open_backend"]


def open_backend(url: str, storage_options: Mapping | None = None, *, retry: RetryPolicy | None = None) -> Backend:
    """Open the backend for ``url``.

    * a plain path or ``file://`` URL -> local directory backend,
    * ``memory://name`` -> process-local in-memory backend (tests, examples),
    * any other fsspec URL (``s3://bucket/prefix`` ...) -> the fsspec backend; writers need a filesystem that
      can create-if-absent atomically (S3 through s3fs: conditional PUT).

    ``retry`` (default :data:`DEFAULT_RETRY`) says how transient storage errors are retried.

    Raises:
        BackendError: the URL's protocol cannot be opened (fsspec implementation missing, bad options).
    """
    options = dict(storage_options or {})
    backend: Backend
    if "://" not in url or url.startswith("file://"):
        backend = LocalBackend(url[len("file://") :] if url.startswith("file://") else url, **options)
    elif url.startswith("memory://"):
        backend = MemoryBackend(url)
    else:
        try:
            import fsspec.core

            fs, root = fsspec.core.url_to_fs(url, **options)
        except (ImportError, ValueError, TypeError, OSError) as e:
            raise BackendError(f"cannot open a filesystem for {url!r}: {e}") from e
        backend = FsspecBackend(fs, root, url)
    if retry is not None:
        backend.retry = retry
    return backend
