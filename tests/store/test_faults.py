"""The store under storage faults, a damaged log and hostile values (issue: no committed record lost or hidden).

S3 faults go through :class:`helpers.faults.FaultProxy` between s3fs and the moto server: 503 SlowDown, 500,
connection resets, delays, requests applied but answered with an error, and an endpoint that goes down. s3fs's
and botocore's own retries are off in most tests so that each injected fault reaches tracestore, which must retry
it or raise a typed error, and never read a failure as "absent".
"""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

import tracestore as ts
from helpers.store import check_batch, rows
from tracestore.cli import main as cli

SITES = [ts.Site("s0", 64)]
FAST = ts.RetryPolicy(attempts=4, base_delay_s=0.01, max_delay_s=0.05, deadline_s=10)
LOG1 = r"/log/000000000001\.arrow$"


@pytest.fixture
def s3(proxy, s3_bucket):
    """(url, storage options through the proxy, raw location without the proxy)."""
    from helpers.store import RawS3

    name, client, options = s3_bucket
    return f"s3://{name}/st", proxy.storage_options(), RawS3(name, "st", client, options)


def _create(url, options, **kw):
    kw.setdefault("gc_grace_s", 3600)
    return ts.create_store(url, SITES, storage_options=options, retry=FAST, **kw)


def _open(url, options, retry=FAST):
    return ts.open_store(url, storage_options=options, retry=retry)


def _commit(store, n: int, tokens: int = 8, prefix: str = "t") -> None:
    """``n`` log entries, one trajectory each."""
    for i in range(n):
        with store.writer(commit_interval_s=0) as w:
            w.write(f"{prefix}{i}", 0, **rows(store, f"{prefix}{i}", 0, tokens))


# ------------------------------------------------------------------ 1. a failed HEAD is not "absent"
@pytest.mark.s3
def test_failed_head_is_not_absent(proxy, s3):
    url, opts, raw = s3
    _commit(_create(url, opts), 5)
    before = raw.snapshot()
    proxy.add("error", "HEAD", LOG1, times=None)  # every HEAD of log/1 answers 503 SlowDown
    store = _open(url, opts)
    with pytest.raises(ts.ThrottledError, match="log/000000000001.arrow"):
        store.head()
    with pytest.raises(ts.TransientStorageError):
        store.snapshot()
    with pytest.raises(ts.TransientStorageError):
        store.reader()
    with pytest.raises(ts.TransientStorageError):
        ts.verify(store)
    for dry in (True, False):
        with pytest.raises(ts.TransientStorageError):
            ts.collect_garbage(store, dry_run=dry, now=time.time() + 1e6)
    assert raw.snapshot() == before  # nothing deleted
    proxy.clear()
    proxy.add("error", "HEAD", LOG1, times=2)  # transient: retried, then the right answer
    store = _open(url, opts)
    assert store.head() == 5 and proxy.stats["error"] >= 2
    assert len(store.reader().traj_ids()) == 5


@pytest.mark.s3
def test_endpoint_down_is_typed(proxy, s3):
    url, opts, _raw = s3
    store = _create(url, opts)
    _commit(store, 2)
    w = store.writer(commit_interval_s=0, commit_timeout_s=1)
    proxy.down()
    with pytest.raises(ts.EndpointError):
        store.snapshot()  # was: a stale log_end without an error
    with pytest.raises(ts.EndpointError):
        _open(url, opts)
    with pytest.raises(ts.EndpointError):
        store.writer()  # a new writer reads the log first
    w.write("late", 0, **rows(store, "late", 0, 8))
    with pytest.raises(ts.TransientStorageError):
        w.flush()
    proxy.up()
    w.close()  # the rows stayed buffered and commit now
    assert "late" in _open(url, opts).reader()


@pytest.mark.s3
def test_close_that_fails_keeps_the_rows_and_can_be_retried(proxy, s3):
    url, opts, _raw = s3
    store = _create(url, opts)
    w = store.writer(commit_interval_s=0, commit_timeout_s=1)
    w.write("a", 0, **rows(store, "a", 0, 8))
    proxy.down()
    with pytest.raises(ts.TransientStorageError):
        w.close()  # used to mark the writer closed: a second close() returned at once and the rows were lost
    proxy.up()
    w.close()
    check_batch(store, _open(url, opts).reader().read("a", 0, 8, fmt="numpy"), "a", 0, 8)


@pytest.mark.s3
def test_write_that_fails_part_way_says_how_far_it_got(proxy, s3):
    url, opts, _raw = s3
    store = _create(url, opts)
    row = store.payload_bytes_per_token + 8  # hint + scale bytes, token id, logprob
    # buffers of 3 rows: a write of 8 tokens hands a full buffer on twice
    w = store.writer(commit_interval_s=0, commit_timeout_s=0.5, commit_bytes=3 * row, max_buffer_bytes=6 * row)
    proxy.add("error", "PUT", r"/data/", times=None)
    with pytest.raises(ts.TransientStorageError) as e:
        w.write("a", 0, **rows(store, "a", 0, 8))
    assert 0 < e.value.buffered_to < 8
    proxy.clear()
    w.write("a", e.value.buffered_to, **rows(store, "a", e.value.buffered_to, 8))
    w.close()
    check_batch(store, _open(url, opts).reader().read("a", 0, 8, fmt="numpy"), "a", 0, 8)


@pytest.mark.s3
def test_write_after_a_failed_handoff_of_a_full_buffer(proxy, s3):
    """A full buffer that could not be handed on stayed the current one; the next write appended an empty
    record to it, and the log entry that committed it was invalid (found by the randomized run)."""
    url, opts, _raw = s3
    store = _create(url, opts)
    row = store.payload_bytes_per_token + 8
    w = store.writer(commit_interval_s=0, commit_timeout_s=0.3, commit_bytes=3 * row, max_buffer_bytes=6 * row)
    proxy.add("error", "PUT", r"/data/", times=None)
    written = 0
    for k in range(4):  # 3-row buffers: a fills, hands on (fails in the background), b fills, hand-on raises
        try:
            w.write("t", 3 * k, **rows(store, "t", 3 * k, 3 * k + 3))
            written = 3 * k + 3
        except ts.TransientStorageError as e:
            written = e.buffered_to
            break
    proxy.clear()
    w.write("t", written, **rows(store, "t", written, 12))
    w.close()
    fresh = _open(url, opts)
    assert ts.verify(fresh).ok
    check_batch(store, fresh.reader().read("t", 0, 12, fmt="numpy"), "t", 0, 12)


@pytest.mark.s3
@pytest.mark.parametrize("argv", [["verify"], ["info"], ["ls"], ["gc", "--dry-run"]])
def test_cli_storage_failure_one_line_exit_2(proxy, s3, argv, capsys, monkeypatch):
    url, opts, _raw = s3
    _create(url, opts)
    proxy.down()
    monkeypatch.setattr("tracestore.storage.base.Backend.retry", FAST)
    rc = cli([argv[0], url, "--storage-options", json.dumps(opts), *argv[1:]])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "EndpointError" in err and url in err, err


@pytest.mark.s3
def test_gc_under_random_throttling_never_plans_committed_segments(proxy, s3):
    url, opts, raw = s3
    store = _create(url, opts)
    _commit(store, 5)
    committed = {e.segment.path for e in store.read_entries(0, store.head())}
    proxy.chaos({"error": 0.3}, seed=7)  # 30% of requests answer 503 SlowDown
    outcomes = {"raised": 0, "ran": 0}
    for _ in range(10):
        try:
            rep = ts.collect_garbage(_open(url, opts, ts.RetryPolicy(attempts=1)), dry_run=True,
                                     now=time.time() + 1e6)
        except ts.TransientStorageError:
            outcomes["raised"] += 1
            continue
        outcomes["ran"] += 1
        assert not set(rep.deleted_segments) & committed
    proxy.clear()
    assert outcomes["raised"] > 0  # with one try per request, 30% faults must have hit some runs
    assert {e.segment.path for e in _open(url, opts).read_entries(0, 5)} == committed
    assert ts.verify(_open(url, opts)).ok and raw.keys()


# ------------------------------------------------------------------ 2. a hole in the log
@pytest.mark.parametrize("missing", [7, 2])
def test_hole_in_the_log_is_an_integrity_error(location, missing, capsys):
    store = ts.create_store(location.url, SITES, storage_options=location.options)
    _commit(store, 10, tokens=4)
    location.delete(f"log/{missing:012d}.arrow")
    before = location.snapshot()
    store = ts.open_store(location.url, storage_options=location.options)
    with pytest.raises(ts.IntegrityError, match=f"{missing:012d}"):
        store.reader()  # (a hole at 7 used to end the log there; a hole at 2 fails reading entry 2)
    report = ts.verify(ts.open_store(location.url, storage_options=location.options))
    assert not report.ok and any(f"{missing:012d}" in e and "missing" in e for e in report.errors), report.errors
    for dry in (True, False):
        with pytest.raises(ts.IntegrityError):
            ts.collect_garbage(ts.open_store(location.url, storage_options=location.options), dry_run=dry,
                               now=time.time() + 1e6)
    with pytest.raises(ts.IntegrityError):  # a new writer must not fill the hole (entries after it reappear)
        with store.writer(commit_interval_s=0) as w:
            w.write("new", 0, **rows(store, "new", 0, 4))
    assert location.snapshot() == before
    if location.options is None and "://" not in location.url:
        assert cli(["verify", location.url]) == 1
        assert f"{missing:012d}" in capsys.readouterr().out


def test_stream_stops_at_a_hole_instead_of_waiting(location):
    store = ts.create_store(location.url, SITES, storage_options=location.options)
    _commit(store, 6, tokens=4)
    location.delete("log/000000000003.arrow")
    stream = ts.open_store(location.url, storage_options=location.options).stream(cursor=None, timeout_s=5)
    seen = []
    with pytest.raises(ts.IntegrityError, match="000000000003"):
        for rec in stream:
            seen.append(rec.traj_id)
    assert seen == ["t0", "t1", "t2"][:len(seen)]  # nothing past the hole


# ------------------------------------------------------------------ 3. out-of-range integers
@pytest.mark.parametrize("kw", [dict(policy_version=2**63), dict(policy_version=-2**63 - 1),
                                dict(token_start=2**63 - 2), dict(token_start=2**63)])
def test_out_of_range_int64_is_refused_and_loses_nothing(tmp_path, kw):
    store = ts.create_store(str(tmp_path / "s"), SITES)
    with store.writer(commit_interval_s=0) as w:
        w.write("good", 0, **rows(store, "good", 0, 4))
        start = kw.pop("token_start", 0)
        args = rows(store, "bad", 0, 4)
        args.update(kw)
        with pytest.raises(ts.ShapeError, match="int64|2\\*\\*63"):
            w.write("bad", start, **args)
    reader = store.reader()
    assert reader.traj_ids() == ["good"]
    check_batch(store, reader.read("good", 0, 4, fmt="numpy"), "good", 0, 4)
    assert ts.verify(store).ok and not ts.verify(store).orphan_segments


def test_float64_logprobs_beyond_float32_are_refused(tmp_path):
    store = ts.create_store(str(tmp_path / "s"), SITES)
    args = rows(store, "t", 0, 4)
    with store.writer(commit_interval_s=0) as w:
        for bad in (np.array([0.0, -1e300, 0.0, 0.0]), __import__("torch").tensor([1e39, 0, 0, 0], dtype=__import__("torch").float64)):
            with pytest.raises(ts.DTypeError, match="float32"):
                w.write("t", 0, **{**args, "logprobs": bad})
        w.write("t", 0, **{**args, "logprobs": np.array([-np.inf, np.nan, -3.0, 0.0])})  # inf/NaN pass unchanged
    lp = store.reader().read("t", 0, 4, fmt="numpy").logprobs
    assert np.isneginf(lp[0]) and np.isnan(lp[1]) and lp[2] == -3.0


# ------------------------------------------------------------------ 4. ambiguous commits are ours
@pytest.mark.s3
@pytest.mark.parametrize("action", ["apply_error", "apply_reset"])
@pytest.mark.parametrize("client_retries", [False, True])
def test_ambiguous_commit_is_read_back_not_a_conflict(proxy, s3, action, client_retries, monkeypatch):
    url, _opts, raw = s3
    opts = proxy.storage_options(client_retries=client_retries)
    if client_retries:
        monkeypatch.undo()  # s3fs retries as configured by default
    store = _create(url, opts)
    proxy.add(action, "PUT", r"/log/000000000000\.arrow$", code="InternalError")
    with store.writer(commit_interval_s=0) as w:  # close() raised OverlapError ("dropped") before the fix
        w.write("a", 0, **rows(store, "a", 0, 8))
        w.write("b", 0, **rows(store, "b", 0, 8))
    assert proxy.stats[action] == 1
    assert w.stats["lost_races"] == 0 and w.stats["records"] == 2
    assert [k for k in raw.keys() if k.startswith("log/")] == ["log/000000000000.arrow"]
    reader = _open(url, opts).reader()
    for t in ("a", "b"):
        check_batch(store, reader.read(t, 0, 8, fmt="numpy"), t, 0, 8)


@pytest.mark.s3
def test_commit_whose_answer_is_lost_is_recognised_at_the_next_flush(proxy, s3):
    url, opts, raw = s3
    store = _create(url, opts)
    w = store.writer(commit_interval_s=0, commit_timeout_s=0.5)
    w.write("a", 0, **rows(store, "a", 0, 8))
    proxy.add("apply_error", "PUT", r"/log/000000000000\.arrow$")  # applied, answered 503
    proxy.add("error", "GET", r"/log/000000000000\.arrow$", times=None)  # and it cannot be read back
    with pytest.raises(ts.TransientStorageError):
        w.flush()
    proxy.clear()
    w.write("b", 0, **rows(store, "b", 0, 8))
    w.close()  # no OverlapError: the entry that landed is this writer's
    assert w.stats["lost_races"] == 0
    entries = _open(url, opts).read_entries(0, 2)
    assert [list(e.traj_ids) for e in entries] == [["a"], ["b"]]
    assert ts.verify(_open(url, opts)).ok


# ------------------------------------------------------------------ 5./6. typed errors, bounded commit loop
@pytest.mark.s3
def test_commit_loop_is_bounded_while_heads_fail(proxy, s3):
    url, opts, _raw = s3
    store = _create(url, opts)
    _commit(store, 1)
    w = store.writer(commit_interval_s=0, commit_timeout_s=2)
    w.write("x", 0, **rows(store, "x", 0, 8))
    proxy.add("error", "HEAD", r"/log/", times=None)
    t0 = time.monotonic()
    with pytest.raises(ts.TransientStorageError):
        w.flush()
    assert time.monotonic() - t0 < 15
    conditional_puts = [1 for m, p, _ in proxy.log if m == "PUT" and "/log/" in p]
    assert len(conditional_puts) == 0  # no futile conditional PUTs while the head is unknown
    proxy.clear()
    w.close()
    assert "x" in _open(url, opts).reader()


@pytest.mark.s3
@pytest.mark.parametrize("code,error", [("InvalidAccessKeyId", ts.CredentialsError),
                                        ("AccessDenied", ts.AccessDeniedError),
                                        ("NoSuchBucket", ts.LocationError)])
def test_s3_refusals_are_typed(proxy, s3, code, error):
    url, opts, _raw = s3
    proxy.add("error", "PUT", r"tracestore\.json$", code=code, times=None)
    with pytest.raises(error):
        _create(url, opts)


@pytest.mark.s3
def test_missing_credentials_are_typed(proxy, s3, monkeypatch, tmp_path):
    url, opts, _raw = s3
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    no_creds = {k: v for k, v in opts.items() if k not in ("key", "secret")}
    with pytest.raises(ts.CredentialsError):
        ts.open_store(url, storage_options=no_creds, retry=FAST)


@pytest.mark.s3
def test_missing_bucket_is_a_location_error(moto_endpoint):
    opts = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": moto_endpoint}}
    with pytest.raises(ts.LocationError, match="bucket"):
        ts.create_store("s3://no-such-bucket-here/x", SITES, storage_options=opts)


# ------------------------------------------------------------------ 7. manifest values
@pytest.mark.parametrize("path,value,match", [
    (("layout", "chunk_rows"), -16, "chunk_rows"), (("layout", "chunk_rows"), 0, "chunk_rows"),
    (("layout", "chunk_rows"), 1.5, "chunk_rows"), (("layout", "shard_bytes"), "16", "shard_bytes"),
    (("top_k",), 0, "top_k"), (("num_experts",), True, "num_experts"), (("gc_grace_s",), -1, "gc_grace_s"),
    (("gc_grace_s",), None, "gc_grace_s"), (("format_version",), True, "format_version"),
    (("store_id",), "a:b", "store_id"), (("sites",), [], "sites"),
    (("sites",), [{"name": "s0", "width": 64, "fp4_format": "fp8"}], "fp4_format"),
    (("moe_layers",), ["m0", "m0"], "duplicate"),
])
def test_manifest_values_are_checked_on_open(tmp_path, path, value, match):
    url = str(tmp_path / "s")
    ts.create_store(url, SITES, moe_layers=["m0"], top_k=2, num_experts=8)
    mpath = tmp_path / "s" / "tracestore.json"
    m = json.loads(mpath.read_text())
    node = m
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    mpath.write_text(json.dumps(m))
    with pytest.raises((ts.IntegrityError, ts.SchemaVersionError), match=match):
        ts.open_store(url)


@pytest.mark.parametrize("grace", [-1, 0, float("nan"), float("inf"), True])
def test_create_store_refuses_bad_gc_grace(tmp_path, grace):
    with pytest.raises(ts.DeclarationError, match="gc_grace_s"):
        ts.create_store(str(tmp_path / "s"), SITES, gc_grace_s=grace)
    assert not (tmp_path / "s").exists()


# ------------------------------------------------------------------ 8. gc grace and commit time
@pytest.mark.parametrize("grace", [0, -1, float("nan"), float("inf")])
def test_gc_refuses_bad_grace(tmp_path, grace):
    store = ts.create_store(str(tmp_path / "s"), SITES)
    with pytest.raises(ts.GcRefusedError):
        ts.collect_garbage(store, grace_s=grace)


def test_gc_refuses_a_grace_below_the_stores_without_force(tmp_path):
    store = ts.create_store(str(tmp_path / "s"), SITES, gc_grace_s=100)
    _commit(store, 1)
    with pytest.raises(ts.GcRefusedError, match="force"):
        ts.collect_garbage(store, grace_s=10)
    assert ts.collect_garbage(store, grace_s=10, force=True).deleted_segments == []


@pytest.mark.s3
def test_slow_commits_lose_nothing_to_a_concurrent_gc(proxy, s3):
    """Every log entry PUT (the writers' and gc's own) takes 3 s to arrive, the grace period is 2 s, gc runs all
    the time: two fixes ago gc deleted every committed segment; one fix ago gc refused to run once it saw a slow
    commit (it had not seen one yet when it deleted). Now gc announces what it deletes in a gc entry first, which
    a slow commit either precedes (gc reads it) or loses its position to (the writer reads the gc entry and writes
    the segment again): nothing is lost and gc keeps running (FORMAT §6)."""
    url, opts, raw = s3
    store = _create(url, opts, gc_grace_s=2)
    proxy.add("delay", "PUT", r"/log/\d+\.arrow$", times=None, delay_s=3.0)
    stop = threading.Event()
    gc_outcomes: list[str] = []

    def gc_loop():
        gs = _open(url, opts)
        while not stop.is_set():
            try:
                ts.collect_garbage(gs)
                gc_outcomes.append("ran")
            except ts.GcRefusedError:
                gc_outcomes.append("refused")
            time.sleep(0.2)

    t = threading.Thread(target=gc_loop)
    t.start()
    written, deadline = 0, time.monotonic() + 120
    try:
        # at least 2 writers, and more until gc has run 6 times beside them (how many runs fit beside 2 slow
        # commits depends on the machine's load: 4 did on a busy CI machine)
        while written < 2 or (len(gc_outcomes) <= 5 and time.monotonic() < deadline):
            with store.writer(commit_interval_s=0) as w:
                w.write(f"t{written}", 0, **rows(store, f"t{written}", 0, 8))
            written += 1
    finally:
        stop.set()
        t.join()
    proxy.clear()
    fresh = _open(url, opts)
    report = ts.verify(fresh)
    assert report.ok, report.errors
    reader = fresh.reader()
    assert sorted(reader.traj_ids()) == sorted(f"t{i}" for i in range(written))
    for i in range(written):
        check_batch(store, reader.read(f"t{i}", 0, 8, fmt="numpy"), f"t{i}", 0, 8)
    assert "refused" not in gc_outcomes and len(gc_outcomes) > 5


# ------------------------------------------------------------------ 9. CLI and parsing
@pytest.mark.parametrize("argv", [["--sites", "2", "--site-name", "{i!z}"],
                                  ["--sites", "2", "--site-name", "fixed"],
                                  ["--sites", "2", "--moe-layers", "2", "--moe-layer-name", "{j}"]])
def test_cli_create_bad_templates(tmp_path, argv, capsys):
    rc = cli(["create", str(tmp_path / "s"), *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "Traceback" not in err, err
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("site", [{"name": "a", "width": 64, "fp4_format": "fp8"},
                                  {"name": "a", "width": 64, "kind": "bogus"},
                                  {"name": "a"}, {"name": "a", "width": 64, "colour": "red"}])
def test_cli_create_bad_site_table(tmp_path, site, capsys):
    (tmp_path / "t.json").write_text(json.dumps([site]))
    rc = cli(["create", str(tmp_path / "s"), "--site-table", str(tmp_path / "t.json")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "Traceback" not in err, err


@pytest.mark.parametrize("argv", [["gc", "--grace", "0"], ["gc", "--grace", "-5"], ["gc", "--grace", "nan"],
                                  ["tail", "--timeout", "-1"], ["ls", "--limit", "0"]])
def test_cli_numbers_checked_at_parse_time(tmp_path, argv, capsys):
    url = str(tmp_path / "s")
    ts.create_store(url, SITES)
    with pytest.raises(SystemExit) as e:
        cli([argv[0], url, *argv[1:]])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument {argv[1]}" in err and ("must be" in err or "finite" in err), err


@pytest.mark.parametrize("seq", [" 1", "0_1", "+1", "\u0661", "1 ", "-0"])
def test_cursor_numbers_are_ascii_digits(tmp_path, seq):
    store = ts.create_store(str(tmp_path / "s"), SITES)
    _commit(store, 2)
    with pytest.raises(ts.SnapshotError):
        store.stream(f"v1:{store.store_id}:{seq}:0")


@pytest.mark.parametrize("field,value", [("log_end", True), ("log_end", 1.0), ("version", True)])
def test_snapshot_booleans_are_not_numbers(tmp_path, field, value):
    store = ts.create_store(str(tmp_path / "s"), SITES)
    _commit(store, 2)
    d = json.loads(store.snapshot().to_json())
    d[field] = value
    with pytest.raises((ts.SnapshotError, ts.SchemaVersionError)):
        store.reader(json.dumps(d))


def test_skip_committed_writers_racing_get_no_overlap_error(tmp_path):
    store = ts.create_store(str(tmp_path / "s"), SITES)
    a = store.writer("a", commit_interval_s=0, skip_committed=True)
    b = store.writer("b", commit_interval_s=0, skip_committed=True)
    a.write("t", 0, **rows(store, "t", 0, 16))
    b.write("t", 8, **rows(store, "t", 8, 24))  # buffered by both: b does not know what a will commit
    a.close()
    b.close()  # raised OverlapError before the fix, although skip_committed says overlaps are skipped
    check_batch(store, store.reader().read("t", 0, 24, fmt="numpy"), "t", 0, 24)
