"""Randomized fault runs: a writer, a tailing reader and gc in parallel on S3 behind the fault-injecting proxy
(503 SlowDown, 500 after applying the request, connection resets before and after applying, delays). Nothing
committed may be lost, duplicated, hidden or reported as a lost race (``helpers.faults.chaos_run`` checks it)."""

from __future__ import annotations

import pytest

from helpers.faults import FaultProxy, chaos_run, no_s3fs_retries

RATES = {"error": 0.04, "reset": 0.02, "apply_error": 0.02, "apply_reset": 0.02, "delay": 0.02}


def _run(moto_endpoint, s3_bucket, monkeypatch, trajectories: int, tokens: int, seed: int) -> dict:
    no_s3fs_retries(monkeypatch)
    name, _client, _options = s3_bucket
    with FaultProxy(moto_endpoint, seed=seed) as proxy:
        return chaos_run(f"s3://{name}/chaos", proxy.storage_options(), proxy, trajectories=trajectories,
                         tokens=tokens, rates=RATES, seed=seed)


@pytest.mark.s3
def test_chaos_short(moto_endpoint, s3_bucket, monkeypatch):
    out = _run(moto_endpoint, s3_bucket, monkeypatch, trajectories=6, tokens=96, seed=3)
    print(out["counts"])
    c = out["counts"]
    assert not out["problems"], out
    assert c["requests"] > 400 and sum(v for k, v in c.items() if k.startswith("faults.")) > 20, c


@pytest.mark.s3
@pytest.mark.long
def test_chaos_long(moto_endpoint, s3_bucket, monkeypatch):
    out = _run(moto_endpoint, s3_bucket, monkeypatch, trajectories=40, tokens=160, seed=11)
    assert not out["problems"], out
    assert out["counts"]["requests"] >= 5000, out["counts"]
