"""Storage backends: the interface (:mod:`.base`) and its implementations, private modules behind it.

* ``base`` — :class:`Backend` (a small key/value object store with one atomic primitive, put-if-absent),
  :class:`ByteRange`, :class:`ObjectInfo`, :class:`RetryPolicy`;
* ``_open`` — :func:`open_backend`, which picks the implementation for a URL;
* ``_local`` — a local directory (the embedded default), ``_memory`` — ``memory://`` (tests, examples),
  ``_fsspec`` — S3 through s3fs and read-only access to other fsspec filesystems.

Every backend passes one shared test suite (``tests/store/test_backend.py``). Nothing here knows the store's
format: keys are opaque ``/``-separated names.
"""

from .base import (
    DEFAULT_RETRY,
    PARTIAL_SUFFIX,
    Backend,
    ByteRange,
    Data,
    ObjectInfo,
    RetryPolicy,
    join_parts,
)
from ._open import open_backend

__all__ = ["Backend", "ByteRange", "Data", "ObjectInfo", "RetryPolicy", "DEFAULT_RETRY", "PARTIAL_SUFFIX",
           "open_backend", "join_parts"]
