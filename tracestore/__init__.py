"""tracestore: store, stream and replay FP4 rollout quantization hints (TRACE) on local disk or S3.

Quick start::

    import tracestore as ts
    store = ts.create_store("/tmp/hints", [ts.Site("layer20.moe_in", 2048)])
    with store.writer() as w:
        w.write("traj-0", 0, hints={...}, scales={...}, token_ids=ids, logprobs=lps)
    batch = store.reader().read("traj-0", 0, 128, fmt="torch")

The on-disk format is specified in ``schemas/FORMAT.md``.
"""

import importlib
from typing import Any

__version__ = "0.1.0"

# Public names -> the module that defines them, imported on first use (PEP 562): ``import tracestore`` and the
# command line's ``--help`` load none of numpy, pyarrow and zarr.
_EXPORTS = {
    "tracestore.format.keys": ("FORMAT_VERSION", "SUPPORTED_FORMAT_VERSIONS", "check_id"),
    "tracestore.store": ("Site", "Store", "Snapshot", "create_store", "open_store"),
    "tracestore.writer": ("Writer",),
    "tracestore.reader": ("Reader", "TrajectoryInfo"),
    "tracestore.stream": ("Stream",),
    "tracestore.batch": ("TraceBatch", "MarginRows", "read_record"),
    "tracestore.records": ("CommittedRecord", "CommittedResult"),
    "tracestore.format.entries": ("Result",),
    "tracestore.maintenance": ("verify", "collect_garbage", "compact", "info", "export_table", "VerifyReport",
                               "GcReport"),
    "tracestore.storage": ("Backend", "ByteRange", "ObjectInfo", "RetryPolicy", "open_backend"),
    "tracestore.objects": ("ObjectArea", "open_area", "RESERVED_AREAS"),
    "tracestore.errors": (
        "TraceStoreError", "SchemaVersionError", "IntegrityError", "HintNotFoundError", "OverlapError",
        "InvalidIdError", "ShapeError", "DTypeError", "UnknownSiteError", "StoreExistsError", "StoreNotFoundError",
        "SnapshotError", "BackendError", "ObjectNotFoundError", "TransientStorageError", "ThrottledError",
        "StorageTimeoutError", "EndpointError", "CredentialsError", "AccessDeniedError", "LocationError",
        "CommitError", "DeclarationError", "GcRefusedError", "GcFenceError", "ResultExistsError",
        "TrajectoryCompleteError", "OptionError", "OptionTypeError",
        "ResultError", "EntryVersionError", "ArrowOverflowError", "SiteEncodingError"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = list(_MODULE_OF)


def __getattr__(name: str) -> Any:
    try:
        module = _MODULE_OF[name]
    except KeyError:
        raise AttributeError(f"module 'tracestore' has no attribute {name!r}") from None
    globals()[name] = value = getattr(importlib.import_module(module), name)  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
