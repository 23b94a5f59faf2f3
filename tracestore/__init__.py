"""tracestore: store, stream and replay FP4 rollout quantization hints (TRACE) on local disk or S3.

Quick start::

    import tracestore as ts
    store = ts.create_store("/tmp/hints", [ts.Site("layer20.moe_in", 2048)])
    with store.writer() as w:
        w.write("traj-0", 0, hints={...}, scales={...}, token_ids=ids, logprobs=lps)
    batch = store.reader().read("traj-0", 0, 128, fmt="torch")

The on-disk format is specified in ``schemas/FORMAT.md``.
"""

from .format.keys import FORMAT_VERSION, SUPPORTED_FORMAT_VERSIONS, check_id
from .storage import Backend, ByteRange, ObjectInfo, RetryPolicy, open_backend
from .errors import (
    AccessDeniedError,
    BackendError,
    CommitError,
    CredentialsError,
    DeclarationError,
    DTypeError,
    EndpointError,
    GcRefusedError,
    ResultExistsError,
    LocationError,
    StorageTimeoutError,
    ThrottledError,
    TransientStorageError,
    HintNotFoundError,
    IntegrityError,
    InvalidIdError,
    ObjectNotFoundError,
    OverlapError,
    SchemaVersionError,
    ShapeError,
    SnapshotError,
    StoreExistsError,
    StoreNotFoundError,
    TraceStoreError,
    UnknownSiteError,
)
from .maintenance import GcReport, VerifyReport, collect_garbage, compact, info, verify
from .reader import Reader, TraceBatch, TrajectoryInfo, read_record
from .format.log import Result
from .stream import CommittedRecord, CommittedResult, Stream
from .store import Site, Snapshot, Store, create_store, open_store
from .writer import Writer
from .objects import RESERVED_AREAS, ObjectArea, open_area

__version__ = "0.1.0"

__all__ = [
    "FORMAT_VERSION", "SUPPORTED_FORMAT_VERSIONS",
    "Site", "Store", "Snapshot", "create_store", "open_store",
    "Writer", "Reader", "Stream", "TraceBatch", "TrajectoryInfo", "CommittedRecord", "CommittedResult", "Result",
    "read_record", "check_id",
    "verify", "collect_garbage", "compact", "info", "VerifyReport", "GcReport",
    "Backend", "ByteRange", "ObjectInfo", "RetryPolicy", "open_backend",
    "ObjectArea", "open_area", "RESERVED_AREAS",
    "TraceStoreError", "SchemaVersionError", "IntegrityError", "HintNotFoundError", "OverlapError",
    "InvalidIdError", "ShapeError", "DTypeError", "UnknownSiteError", "StoreExistsError", "StoreNotFoundError",
    "SnapshotError", "BackendError", "ObjectNotFoundError", "TransientStorageError", "ThrottledError",
    "StorageTimeoutError", "EndpointError", "CredentialsError", "AccessDeniedError", "LocationError", "CommitError",
    "DeclarationError", "GcRefusedError", "ResultExistsError",
]
