"""Shared fixtures: a moto S3 server on 127.0.0.1 (session-scoped, free port), a bucket per test, and the
``backend`` parametrization (local directory, in-memory, S3) used by the store test suite."""

from __future__ import annotations

import logging
import os
import socket
import uuid

import pytest

# dummy credentials: nothing here talks to AWS
for _k, _v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing",
               "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1"}.items():
    os.environ.setdefault(_k, _v)
os.environ.pop("AWS_PROFILE", None)
os.environ.pop("AWS_ENDPOINT_URL", None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _make_conditional_put_atomic() -> None:
    """moto checks ``If-None-Match: *`` and stores the object in two steps without a lock, so two concurrent
    conditional PUTs of one key can both succeed on its threaded server; AWS S3 makes the check atomic, and the
    commit protocol relies on that. Serialize conditional PUTs (only those) so the test server has S3's
    semantics; the server runs in this process, so its request handlers see the patch."""
    import threading

    from moto.s3.responses import S3Response

    if getattr(S3Response, "_tracestore_atomic", False) or not hasattr(S3Response, "put_object"):
        return
    lock = threading.Lock()
    original = S3Response.put_object

    def put_object(self, *args, **kwargs):
        if self.headers.get("If-None-Match") == "*":
            with lock:
                return original(self, *args, **kwargs)
        return original(self, *args, **kwargs)

    S3Response.put_object = put_object
    S3Response._tracestore_atomic = True


@pytest.fixture(scope="session")
def moto_endpoint():
    """URL of a moto S3 server started for this test session."""
    from moto.server import ThreadedMotoServer

    _make_conditional_put_atomic()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def s3_bucket(moto_endpoint):
    """A fresh, empty bucket: (bucket name, boto3 client, s3fs storage_options)."""
    import boto3

    name = f"ts-{uuid.uuid4().hex[:16]}"
    client = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    client.create_bucket(Bucket=name)
    options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": moto_endpoint},
               "skip_instance_cache": False}
    yield name, client, options


@pytest.fixture(params=["local", "memory", pytest.param("s3", marks=pytest.mark.s3)])
def backend_kind(request) -> str:
    return request.param


@pytest.fixture
def location(backend_kind, tmp_path, request):
    """A store location on the parametrized backend, with a raw accessor that bypasses tracestore."""
    from helpers.store import RawLocal, RawMemory, RawS3

    if backend_kind == "local":
        root = tmp_path / "store"
        return RawLocal(str(root))
    if backend_kind == "memory":
        raw = RawMemory(f"memory://{uuid.uuid4().hex}")
        request.addfinalizer(raw.clear)
        return raw
    name, client, options = request.getfixturevalue("s3_bucket")
    return RawS3(name, "stores/a", client, options)
