"""Fixtures of the store suite beside the shared ones in ``tests/conftest.py``."""

from __future__ import annotations

import pytest

from helpers.faults import FaultProxy, no_s3fs_retries


@pytest.fixture
def proxy(moto_endpoint, monkeypatch):
    """A :class:`~helpers.faults.FaultProxy` in front of the session's moto server, with s3fs's own retries off
    (each injected fault reaches tracestore)."""
    no_s3fs_retries(monkeypatch)
    with FaultProxy(moto_endpoint, seed=1) as p:
        yield p
