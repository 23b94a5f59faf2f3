"""fsspec backend: S3 through s3fs, and read-only access to any other fsspec filesystem.

Atomic create-if-absent on S3 is a conditional ``PUT`` with ``If-None-Match: *`` (s3fs
``pipe_file(..., mode="create")``; AWS S3 since 2024, moto's server, MinIO). Filesystems without a known
atomic create (most other fsspec implementations) open read-only: ``supports_put_if_absent`` is false and
creating a writer raises :class:`~tracestore.errors.BackendError`.

fsspec's listing cache is never trusted: it is invalidated before every ``find``, ``exists`` and whole-object
GET (s3fs sizes whole-object reads through it), and after every ``find``. Tailing does not list at all (it
GETs the next log key).

"Absent" is only what the storage said (404 / NoSuchKey). fsspec's ``isfile``/``exists`` swallow every error and
answer False, so they are never used: ``exists`` is a HEAD (S3) or ``info`` whose errors are classified. Every
call runs under the backend's :class:`~tracestore.storage.RetryPolicy`; failures become typed errors by
:func:`classify_error` (throttling, 5xx, timeouts, resets, refused connections are transient and retried;
credentials, permissions, missing buckets are not).
"""

from __future__ import annotations

import datetime as _dt
import errno
import logging
from collections.abc import Iterator, Mapping, Sequence

from .base import Backend, ByteRange, Data, ObjectInfo, _check_key, join_parts
from ..errors import (
    AccessDeniedError,
    BackendError,
    CredentialsError,
    EndpointError,
    LocationError,
    ObjectNotFoundError,
    StorageTimeoutError,
    ThrottledError,
    TransientStorageError,
)

log = logging.getLogger(__name__)

_CONDITIONAL_PUT_PROTOCOLS = {"s3", "s3a"}
_OBJECT_STORE_PROTOCOLS = {"s3", "s3a", "gs", "gcs", "az", "abfs", "adl", "memory", "http", "https"}

# S3 error codes (and the bare status codes botocore reports for body-less HEAD responses)
_THROTTLE_CODES = {"SlowDown", "ServiceUnavailable", "Throttling", "ThrottlingException", "RequestLimitExceeded",
                   "TooManyRequests", "TooManyRequestsException", "RequestThrottled", "503", "429"}
_TRANSIENT_CODES = {"InternalError", "InternalServerError", "RequestTimeout", "RequestTimeoutException",
                    "BadGateway", "GatewayTimeout", "OperationAborted", "500", "502", "504"}
_CREDENTIAL_CODES = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "ExpiredTokenException",
                     "InvalidToken", "TokenRefreshRequired", "InvalidSecurity", "AuthorizationHeaderMalformed"}
_LOCATION_CODES = {"NoSuchBucket", "InvalidBucketName", "PermanentRedirect", "AllAccessDisabled"}
# exception class names (botocore, aiohttp, fsspec, builtins) by what they mean; matched along the cause chain
_CREDENTIAL_NAMES = {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError",
                     "UnauthorizedSSOTokenError", "NoAuthTokenError"}
_TIMEOUT_NAMES = {"ReadTimeoutError", "ConnectTimeoutError", "FSTimeoutError", "ServerTimeoutError", "TimeoutError"}
_ENDPOINT_NAMES = {"EndpointConnectionError", "ConnectionClosedError", "ProxyConnectionError", "ConnectionError",
                   "ClientConnectionError", "ClientConnectorError", "ServerDisconnectedError", "ClientOSError"}
_TRANSIENT_NAMES = {"IncompleteRead", "ResponseParserError", "ClientPayloadError", "HTTPClientError",
                    "ResponseStreamingError"}


def _chain(e: BaseException) -> Iterator[BaseException]:
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _s3_code(e: BaseException) -> tuple[str | None, int | None]:
    """(S3 error code, HTTP status) of the first botocore ClientError along the cause chain."""
    for x in _chain(e):
        response = getattr(x, "response", None)
        if isinstance(response, Mapping):
            code = (response.get("Error") or {}).get("Code")
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            return (str(code) if code is not None else None), (int(status) if status is not None else None)
    return None, None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    text = text[0] if text else ""
    text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def classify_error(e: BaseException, what: str, url: str) -> BackendError:
    """The tracestore error for a failed storage call ``what`` on ``url`` (one line: operation, URL, cause).

    Absent objects become :class:`ObjectNotFoundError`; missing buckets :class:`LocationError`; rejected or missing
    credentials :class:`CredentialsError`; other denials :class:`AccessDeniedError`; throttling, 5xx, timeouts,
    connection errors the transient subclasses (retried by :meth:`Backend.call`); anything else BackendError."""
    if isinstance(e, BackendError):
        return e
    code, status = _s3_code(e)
    names = {c.__name__ for x in _chain(e) for c in type(x).__mro__}
    cause = _first_line(e)
    if code in _LOCATION_CODES:
        return LocationError(f"{what} in {url}: the bucket does not exist or cannot be used ({code}): {cause}")
    if code in _CREDENTIAL_CODES or names & _CREDENTIAL_NAMES:
        return CredentialsError(f"{what} in {url}: credentials missing or rejected ({code or 'no credentials'}); "
                                f"set key/secret in storage options or AWS_* variables: {cause}")
    if code in _THROTTLE_CODES:
        return ThrottledError(f"{what} in {url}: throttled by the storage ({code}): {cause}")
    if code in _TRANSIENT_CODES or (status is not None and status >= 500):
        return TransientStorageError(f"{what} in {url}: storage error {code or status}: {cause}")
    if names & _TIMEOUT_NAMES:
        return StorageTimeoutError(f"{what} in {url}: timed out: {cause}")
    if names & _ENDPOINT_NAMES or isinstance(e, ConnectionError):
        return EndpointError(f"{what} in {url}: endpoint unreachable or connection lost: {cause}")
    if names & _TRANSIENT_NAMES:
        return TransientStorageError(f"{what} in {url}: incomplete or garbled response: {cause}")
    if isinstance(e, FileNotFoundError) or code in ("NoSuchKey", "404"):
        return ObjectNotFoundError(f"{what} in {url}: not found")
    if isinstance(e, PermissionError) or code in ("AccessDenied", "403"):
        return AccessDeniedError(f"{what} in {url}: access denied: {cause}")
    if isinstance(e, OSError) and e.errno == errno.EBUSY:
        return ThrottledError(f"{what} in {url}: storage busy: {cause}")
    if isinstance(e, OSError) and e.errno == getattr(errno, "EREMOTEIO", errno.EIO) and code is not None:
        return TransientStorageError(f"{what} in {url}: storage error {code}: {cause}")
    return BackendError(f"{what} in {url} failed: {cause}")


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
        self._s3 = bool(_CONDITIONAL_PUT_PROTOCOLS.intersection(protocols)) and hasattr(fs, "call_s3")
        self.supports_put_if_absent = bool(_CONDITIONAL_PUT_PROTOCOLS.intersection(protocols))
        # object stores have no directories; hierarchical filesystems need parents created
        self._make_dirs = not _OBJECT_STORE_PROTOCOLS.intersection(protocols)

    def _path(self, key: str) -> str:
        _check_key(key)
        return f"{self.root}/{key}"

    def classify(self, error: BaseException, what: str) -> BackendError:
        return classify_error(error, what, self.url)

    def _raise_failed(self, values: Sequence, keys: Sequence[str], verb: str, *, absent_ok: bool) -> None:
        """Raise the typed error of the first failed item of a batch call (``on_error="return"``)."""
        for key, value in zip(keys, values):
            if isinstance(value, BaseException):
                err = classify_error(value, f"{verb} {key!r}", self.url)
                if absent_ok and isinstance(err, ObjectNotFoundError):
                    continue
                raise err from value

    def get(self, key: str) -> bytes:
        path = self._path(key)

        def fn() -> bytes:
            # s3fs sizes whole-object reads through its listing cache: drop it so a new object is found
            self.fs.invalidate_cache(path)
            return self.fs.cat_file(path)

        return self.call(f"GET {key!r}", fn)

    def get_range(self, key: str, start: int, stop: int) -> bytes:
        if stop <= start:
            return b""
        return self.call(f"GET {key!r} [{start}, {stop})",
                         lambda: self.fs.cat_file(self._path(key), start=start, end=stop))

    def get_ranges(self, ranges: Sequence[ByteRange]) -> list[bytes]:
        if len(ranges) <= 1:
            return [self.get_range(r.key, r.start, r.stop) for r in ranges]
        paths = [self._path(r.key) for r in ranges]

        def fn() -> list[bytes]:
            out = self.fs.cat_ranges(paths, [r.start for r in ranges], [r.stop for r in ranges], on_error="return")
            self._raise_failed(out, [r.key for r in ranges], "GET range of", absent_ok=False)
            return list(out)

        return self.call(f"GET {len(ranges)} ranges", fn)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        paths = [self._path(k) for k in keys]

        def fn() -> list[bytes | None]:
            for p in paths:
                self.fs.invalidate_cache(p)
            out = self.fs.cat(paths, on_error="return")
            if not isinstance(out, dict):  # a single path returns bytes
                out = {paths[0]: out}
            values = [out.get(p, out.get(self.fs._strip_protocol(p))) for p in paths]
            self._raise_failed(values, keys, "GET", absent_ok=True)
            return [None if (v is None or isinstance(v, BaseException)) else v for v in values]

        return self.call(f"GET {len(keys)} objects", fn)

    def _parents(self, paths) -> None:
        if self._make_dirs:
            for parent in {p.rsplit("/", 1)[0] for p in paths}:
                self.fs.makedirs(parent, exist_ok=True)

    def put(self, key: str, data: Data) -> None:
        body = join_parts(data)

        def fn() -> None:
            self._parents([self._path(key)])
            self.fs.pipe_file(self._path(key), body)

        self.call(f"PUT {key!r}", fn)

    def put_many(self, items: Mapping[str, Data], *, atomic: bool = True) -> None:
        if len(items) <= 1:  # an object-store PUT is atomic either way
            for key, data in items.items():
                self.put(key, data)
            return
        bodies = {self._path(k): join_parts(v) for k, v in items.items()}

        def fn() -> None:
            # async filesystems (s3fs) send these concurrently
            self._parents(list(bodies))
            self.fs.pipe(bodies)

        self.call(f"PUT {len(items)} objects (first {next(iter(items))!r})", fn)

    def put_if_absent(self, key: str, data: Data) -> bool:
        """Conditional create. After a transient failure the request may have been applied, so a retry can answer
        False for this very call's object: callers that must know (the writer's commit) read the object back."""
        if not self.supports_put_if_absent:
            raise BackendError(
                f"{self.url}: filesystem {type(self.fs).__name__} has no atomic create-if-absent; "
                f"tracestore can read from it but not commit to it (supported: local directories, S3)"
            )
        body = join_parts(data)

        def fn() -> bool:
            try:
                self.fs.pipe_file(self._path(key), body, mode="create")
                return True
            except FileExistsError:
                return False

        return self.call(f"conditional PUT {key!r}", fn)

    def exists(self, key: str) -> bool:
        path = self._path(key)

        def fn() -> bool:
            try:
                if self._s3:
                    bucket, obj, _ = self.fs.split_path(path)
                    self.fs.call_s3("head_object", Bucket=bucket, Key=obj)
                    return True
                self.fs.invalidate_cache(path)
                return self.fs.info(path).get("type", "file") == "file"
            except FileNotFoundError as e:
                err = classify_error(e, f"HEAD {key!r}", self.url)
                if isinstance(err, ObjectNotFoundError):
                    return False
                raise err from e

        return self.call(f"HEAD {key!r}", fn)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        base = self.root
        directory = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        path = f"{base}/{directory}" if directory else base

        def fn() -> dict:
            self.fs.invalidate_cache(path)
            try:
                return self.fs.find(path, detail=True)
            except FileNotFoundError as e:
                err = classify_error(e, f"LIST {prefix!r}", self.url)
                if isinstance(err, ObjectNotFoundError):
                    return {}
                raise err from e
            finally:
                self.fs.invalidate_cache(path)  # leave no listing behind that later lookups could trust

        found = self.call(f"LIST {prefix!r}", fn)
        out = []
        for name, info in found.items():
            if info.get("type", "file") != "file":
                continue
            key = name[len(base) + 1 :] if name.startswith(base + "/") else name
            if key.startswith(prefix):
                out.append(ObjectInfo(key, int(info.get("size") or 0), _mtime(info)))
        out.sort(key=lambda o: o.key)
        return out

    def list_after(self, prefix: str, start_after: str, limit: int = 1000) -> list[str]:
        if not self._s3:
            return super().list_after(prefix, start_after, limit)
        bucket, root_key, _ = self.fs.split_path(self.root + "/x")
        root_key = root_key[:-1]  # "<prefix of the store>/"

        def fn() -> list[str]:
            resp = self.fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=root_key + prefix,
                                   StartAfter=root_key + start_after, MaxKeys=int(limit))
            return [o["Key"][len(root_key):] for o in resp.get("Contents", [])]

        return self.call(f"LIST {prefix!r} after {start_after!r}", fn)

    def delete(self, key: str) -> None:
        def fn() -> None:
            try:
                self.fs.rm_file(self._path(key))
            except FileNotFoundError:
                pass

        self.call(f"DELETE {key!r}", fn)

    def delete_many(self, keys) -> None:
        paths = [self._path(k) for k in keys]
        if not paths:
            return

        def fn() -> None:
            try:
                self.fs.rm(paths)
            except FileNotFoundError:
                pass

        self.call(f"DELETE {len(paths)} objects", fn)
