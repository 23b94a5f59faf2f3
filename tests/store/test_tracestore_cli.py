"""The ``tracestore`` command line, in-process (``main([...])``) and as a subprocess, on small stores built here:
help texts, JSON outputs that agree with the library, verify/gc/tail behaviour, error handling, a tiny bench."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

import tracestore as ts
from helpers.store import rows
from tracestore.cli import main

SITES = [ts.Site("l0.moe_in", 64), ts.Site("l1.moe_in", 64), ts.Site("l2.attn_o", 128, fp4_format="mxfp4")]
MOE = dict(moe_layers=["l0", "l1"], top_k=2, num_experts=16)
COMMANDS = ["create", "info", "ls", "show", "tail", "verify", "gc", "compact", "export", "bench"]
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _build(url: str, storage_options=None) -> ts.Store:
    """3 trajectories, 2 writers, 4 log entries, policy versions 0..2, a gap in traj-c."""
    store = ts.create_store(url, SITES, model={"name": "tiny"}, chunk_rows=16, shard_bytes=4096,
                            storage_options=storage_options, **MOE)
    with store.writer("w0", commit_interval_s=0) as w:
        w.write("traj-a", 0, **rows(store, "traj-a", 0, 40))
        w.write("traj-b", 0, **rows(store, "traj-b", 0, 25, policy_version=1))
        w.flush()
        w.write("traj-a", 40, **rows(store, "traj-a", 40, 70, policy_version=1))
    with store.writer("w1", commit_interval_s=0) as w:
        w.write("traj-c", 0, **rows(store, "traj-c", 0, 10, policy_version=2))
        w.flush()
        w.write("traj-c", 20, **rows(store, "traj-c", 20, 33, policy_version=2))
    return store


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> str:
    url = str(tmp_path_factory.mktemp("cli") / "store")
    _build(url).close()
    return url


@pytest.fixture
def fresh(tmp_path, built) -> str:
    """A private copy of the built store (for tests that damage or change it)."""
    dst = str(tmp_path / "store")
    shutil.copytree(built, dst)
    return dst


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def run_json(argv: list[str], capsys):
    code, out, err = run(argv, capsys)
    assert code == 0, err
    return json.loads(out)


def sub(*argv: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tracestore.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, **kw)


# ---------------------------------------------------------------------------------------------- help
@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help(command, capsys):
    argv = ([command] if command else []) + ["--help"]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "usage: tracestore" in out
    if command is None:
        assert all(c in out for c in COMMANDS)
    else:
        assert "--storage-options" in out and "--debug" in out


def test_help_subprocess_and_console_script():
    r = sub("--help")
    assert r.returncode == 0 and "verify" in r.stdout
    exe = shutil.which("tracestore")
    if exe is None:
        pytest.skip("console script not on PATH")
    r = subprocess.run([exe, "tail", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--from-start" in r.stdout and "--cursor" in r.stdout


# ---------------------------------------------------------------------------------------------- info / ls / show
def test_info_json_agrees_with_library(built, capsys):
    got = run_json(["info", built, "--json"], capsys)
    want = json.loads(json.dumps(ts.info(ts.open_store(built))))
    assert got == want
    assert got["tokens"] == 70 + 25 + 23 and got["trajectories"] == 3 and got["log_entries"] == 4
    code, out, _ = run(["info", built], capsys)
    assert code == 0 and "3 trajectories" in out and "118 tokens" in out and "payload" in out


def test_ls_json_agrees_with_library(built, capsys):
    got = run_json(["ls", built, "--json"], capsys)
    reader = ts.open_store(built).reader()
    assert got["snapshot"] == json.loads(reader.snapshot.to_json())
    want = reader.trajectories()
    assert [t["traj_id"] for t in got["trajectories"]] == [i.traj_id for i in want]
    for g, w in zip(got["trajectories"], want):
        assert g["num_tokens"] == w.num_tokens and g["committed_tokens"] == w.committed_tokens
        assert [tuple(r) for r in g["ranges"]] == list(w.ranges)
        assert tuple(g["policy_versions"]) == w.policy_versions and tuple(g["writers"]) == w.writers
    c = got["trajectories"][2]
    assert c["traj_id"] == "traj-c" and c["ranges"] == [[0, 10], [20, 33]] and c["num_tokens"] == 10
    assert run_json(["ls", built, "--json", "--prefix", "traj-b"], capsys)["trajectories"][0]["writers"] == ["w0"]
    # pinned snapshot: the first log entry only
    snap = json.dumps({"kind": "tracestore.snapshot", "version": 1, "store_id": reader.store.store_id, "log_end": 1})
    pinned = run_json(["ls", built, "--json", "--snapshot", snap], capsys)
    assert {t["traj_id"]: t["committed_tokens"] for t in pinned["trajectories"]} == {"traj-a": 40, "traj-b": 25}
    code, out, _ = run(["ls", built], capsys)
    assert code == 0 and "traj-c" in out and "3 trajectories, 118 tokens" in out


def test_show_json_agrees_with_library(built, capsys):
    got = run_json(["show", built, "traj-a", "--json", "--tokens", "38:43", "--site", "l2.attn_o", "--rows", "0"],
                   capsys)
    store = ts.open_store(built)
    assert [(r["token_start"], r["token_stop"], r["policy_version"], r["writer_id"]) for r in got["records"]] == \
        [(0, 40, 0, "w0"), (40, 70, 1, "w0")]
    tok = got["tokens"]
    want = rows(store, "traj-a", 38, 43)
    assert (tok["start"], tok["stop"], tok["rows_shown"]) == (38, 43, 5) and list(tok["sites"]) == ["l2.attn_o"]
    assert [bytes.fromhex(h) for h in tok["sites"]["l2.attn_o"]["hints"]] == \
        [r.tobytes() for r in want["hints"]["l2.attn_o"]]
    assert [bytes.fromhex(h) for h in tok["sites"]["l2.attn_o"]["scales"]] == \
        [r.tobytes() for r in want["scales"]["l2.attn_o"]]
    assert tok["token_ids"] == want["token_ids"].tolist()
    np.testing.assert_array_equal(np.float32(tok["logprobs"]), want["logprobs"])
    assert tok["policy_version"] == [0, 0, 1, 1, 1]
    assert tok["experts"]["l1"] == want["experts"]["l1"].tolist()
    code, out, _ = run(["show", built, "traj-a", "--tokens", "0:2"], capsys)
    assert code == 0 and "[40, 70)" in out and "site l0.moe_in" in out and "hints" in out
    # positions that are not committed: a typed error, exit 2
    code, _, err = run(["show", built, "traj-c", "--tokens", "5:15"], capsys)
    assert code == 2 and err.count("\n") == 1 and "HintNotFoundError" in err


# ---------------------------------------------------------------------------------------------- verify / gc
def test_verify_ok_and_detects_a_flipped_payload_byte(fresh, capsys):
    code, out, _ = run(["verify", fresh], capsys)
    assert code == 0 and out.startswith("OK")
    d = run_json(["verify", fresh, "--json"], capsys)
    assert d["ok"] and d["errors"] == [] and d["entries"] == 4
    shard = sorted(glob.glob(os.path.join(fresh, "data", "w0", "*", "hints.w64.b16", "0.0.0")))[0]
    with open(shard, "r+b") as f:
        f.seek(3)
        b = f.read(1)
        f.seek(3)
        f.write(bytes([b[0] ^ 0x10]))
    code, out, err = run(["verify", fresh, "--json"], capsys)
    assert code == 1
    d = json.loads(out)
    assert not d["ok"] and len(d["errors"]) == 1 and "crc32c mismatch" in d["errors"][0]
    assert "hints.w64.b16/0.0.0" in d["errors"][0]
    assert err.count("\n") == 1 and "1 problem" in err and "crc32c mismatch" in err
    r = sub("verify", fresh)
    assert r.returncode == 1 and "FAILED" in r.stdout and "Traceback" not in r.stderr


def test_gc_dry_run_then_real(fresh, capsys):
    # an orphan: a copy of a committed segment under a name no log entry references, made old
    seg = sorted(glob.glob(os.path.join(fresh, "data", "w1", "*")))[0]
    orphan = os.path.join(fresh, "data", "w1", "00000099-0123456789ab")
    shutil.copytree(seg, orphan)
    old = time.time() - 7200
    for dirpath, _, files in os.walk(orphan):
        for f in files:
            os.utime(os.path.join(dirpath, f), (old, old))
    n_files = sum(len(f) for _, _, f in os.walk(orphan))
    # within the grace period: kept
    d = run_json(["gc", fresh, "--dry-run", "--grace", "1e9", "--json"], capsys)
    assert d["deleted_segments"] == [] and d["young_segments"] == ["data/w1/00000099-0123456789ab"]
    d = run_json(["gc", fresh, "--dry-run", "--json"], capsys)  # default grace 1 h < 2 h old
    assert d["dry_run"] and d["deleted_segments"] == ["data/w1/00000099-0123456789ab"]
    assert d["deleted_objects"] == n_files and os.path.isdir(orphan)
    code, out, _ = run(["gc", fresh, "--dry-run"], capsys)
    assert code == 0 and out.startswith("would delete 1 segments")
    d = run_json(["gc", fresh, "--json"], capsys)
    assert not d["dry_run"] and d["deleted_objects"] == n_files and not os.path.exists(orphan)
    assert run_json(["gc", fresh, "--json"], capsys)["deleted_segments"] == []
    assert run_json(["verify", fresh, "--json"], capsys)["ok"]
    assert run_json(["info", fresh, "--json"], capsys)["tokens"] == 118


def test_compact(fresh, capsys):
    assert run_json(["compact", fresh, "--json"], capsys) == {"checkpoint_log_end": 4}
    assert run_json(["compact", fresh, "--json"], capsys) == {"checkpoint_log_end": None}  # already at the head
    assert run_json(["info", fresh, "--json"], capsys)["bytes"]["checkpoints"] > 0
    assert run_json(["verify", fresh, "--json"], capsys)["ok"]
    assert [t["traj_id"] for t in run_json(["ls", fresh, "--json"], capsys)["trajectories"]] == \
        ["traj-a", "traj-b", "traj-c"]


# ---------------------------------------------------------------------------------------------- tail
def _lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def test_tail_json_resumes_exactly_from_its_cursor(built, capsys):
    store = ts.open_store(built)
    want = [(r.seq, r.index, r.traj_id, r.token_start, r.token_stop) for r in store.stream(timeout_s=0).poll()]
    assert len(want) == 5
    first = _lines(run(["tail", built, "--json", "--from-start", "--max-records", "2"], capsys)[1])
    assert len(first) == 3 and first[-1]["records"] == 2
    cursor = first[-1]["cursor"]
    assert first[1]["cursor"] == cursor  # the cursor printed with a record is the position after it
    second = _lines(run(["tail", built, "--json", "--cursor", cursor, "--timeout", "0.2"], capsys)[1])
    got = [(d["seq"], d["index"], d["traj_id"], d["token_start"], d["token_stop"]) for d in first[:-1] + second[:-1]]
    assert got == want
    # resuming from the final cursor yields nothing new; from the head by default too
    end = second[-1]["cursor"]
    assert _lines(run(["tail", built, "--json", "--cursor", end, "--timeout", "0.1"], capsys)[1]) == \
        [{"cursor": end, "records": 0}]
    assert _lines(run(["tail", built, "--json", "--timeout", "0.1"], capsys)[1])[-1]["cursor"] == end
    code, out, _ = run(["tail", built, "--from-start", "--timeout", "0.1"], capsys)
    assert code == 0 and out.splitlines()[-1] == f"cursor {end}" and "traj-c [20, 33)" in out
    # a cursor of another store, or a malformed one: exit 2, one line
    other = end.split(":")
    other[1] = "0" * 32
    code, _, err = run(["tail", built, "--cursor", ":".join(other), "--timeout", "0"], capsys)
    assert code == 2 and "SnapshotError" in err and err.count("\n") == 1


def test_tail_follows_new_commits(fresh):
    store = ts.open_store(fresh)
    # an explicit cursor at the head: no race with the subprocess's start-up
    proc = subprocess.Popen([sys.executable, "-m", "tracestore.cli", "tail", fresh, "--json", "--timeout", "30",
                             "--max-records", "1", "--cursor", store.snapshot().to_cursor()],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        time.sleep(0.5)  # usually the tail is polling by now; either way it starts at the cursor
        with store.writer("w2", commit_interval_s=0) as w:
            w.write("traj-new", 0, **rows(store, "traj-new", 0, 5, policy_version=7))
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    lines = _lines(out)
    assert lines[0]["traj_id"] == "traj-new" and lines[0]["policy_version"] == 7 and lines[0]["seq"] == 4
    assert lines[-1] == {"cursor": f"v1:{store.store_id}:5:0", "records": 1}


# ---------------------------------------------------------------------------------------------- create / errors
def test_create_from_site_table_and_from_flags(tmp_path, capsys):
    table = tmp_path / "sites.json"
    table.write_text(json.dumps({"sites": [s.to_dict() for s in SITES], "moe_layers": ["a", "b"], "top_k": 2,
                                 "num_experts": 8, "model": {"name": "x"}}))
    d = run_json(["create", str(tmp_path / "s1"), "--site-table", str(table), "--json"], capsys)
    store = ts.open_store(str(tmp_path / "s1"))
    assert list(store.sites) == [s.name for s in SITES] and store.moe_layers == ("a", "b") and store.model == {"name": "x"}
    assert d["store_id"] == store.store_id and d["tokens"] == 0
    code, out, _ = run(["create", str(tmp_path / "s2"), "--sites", "20", "--width", "2048", "--moe-layers", "40"],
                       capsys)
    assert code == 0 and "7,680 payload bytes/token" in out
    s2 = ts.open_store(str(tmp_path / "s2"))
    assert s2.payload_bytes_per_token == 7680 and s2.trace_bytes_per_token == 8 + 40 * 8
    # again: the store exists -> exit 2 (one line); --exist-ok opens it
    code, _, err = run(["create", str(tmp_path / "s2"), "--sites", "20", "--moe-layers", "40"], capsys)
    assert code == 2 and "StoreExistsError" in err and err.count("\n") == 1
    assert run(["create", str(tmp_path / "s2"), "--sites", "20", "--moe-layers", "40", "--exist-ok"], capsys)[0] == 0
    # bad input: no traceback, exit 2
    code, _, err = run(["create", str(tmp_path / "s3"), "--sites", "2", "--width", "40"], capsys)
    assert code == 2 and "ShapeError" in err
    code, _, err = run(["create", str(tmp_path / "s3")], capsys)
    assert code == 2 and "--site-table" in err


def test_errors_are_one_line_exit_2(tmp_path, capsys):
    missing = str(tmp_path / "nothing-here")
    r = sub("info", missing)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "StoreNotFoundError" in r.stderr and missing in r.stderr
    assert "Traceback" not in r.stderr
    for argv in (["ls", missing], ["show", missing, "t"], ["verify", missing], ["gc", missing],
                 ["tail", missing, "--timeout", "0"]):
        code, _, err = run(argv, capsys)
        assert code == 2 and err.startswith(f"tracestore {argv[0]}: error: StoreNotFoundError"), err
    code, _, err = run(["info", missing, "--storage-options", "{not json"], capsys)
    assert code == 2 and "not valid JSON" in err
    code, _, err = run(["info", missing, "--storage-options", '{"anon": true}'], capsys)  # S3 option, local path
    assert code == 2 and err.count("\n") == 1
    with pytest.raises(ts.StoreNotFoundError):
        main(["info", missing, "--debug"])
    r = sub("info", missing, "--debug")
    assert r.returncode == 1 and "Traceback" in r.stderr
    with pytest.raises(SystemExit) as e:  # argparse usage errors exit 2 as well
        main(["info"])
    assert e.value.code == 2


# ---------------------------------------------------------------------------------------------- bench
TINY = ["--trajectories", "2", "--tokens", "48", "--sites", "2", "--width", "64", "--moe-layers", "2",
        "--write-tokens", "16", "--repeats", "1", "--tail-commits", "3"]


def test_bench_json_tiny_local(tmp_path, capsys):
    out_file = tmp_path / "bench.json"
    d = run_json(["bench", "--json", "--no-s3", "--url", str(tmp_path / "b"), "--out", str(out_file), *TINY], capsys)
    assert json.loads(out_file.read_text()) == d
    assert d["payload_bytes_per_token"] == 2 * (8 + 4) and d["trace_bytes_per_token"] == 8 + 2 * 8
    assert d["bytes_per_token"] > d["payload_bytes_per_token"] + d["trace_bytes_per_token"] - 1e-9
    for k in ("write_ratio_local", "read_ratio_local", "tail_latency_s", "tail_latency_p95_s", "overhead_payload",
              "overhead_total"):
        assert isinstance(d[k], float) and d[k] >= 0, k
    assert d["local"]["tokens"] == 96 and d["local"]["write_MBps_store"] > 0 and d["s3"] is None
    assert d["tail"]["seen"] == 3 and d["machine"]["cpu_count"] == os.cpu_count()
    assert d["versions"]["tracestore"] == ts.__version__
    assert os.listdir(tmp_path / "b") == []  # the bench removes what it wrote
    code, out, _ = run(["bench", "--no-s3", "--url", str(tmp_path / "b"), *TINY], capsys)
    assert code == 0 and "write_ratio_local" in out and "tail latency" in out


@pytest.mark.s3
def test_bench_and_info_on_s3(moto_endpoint, s3_bucket, capsys):
    d = run_json(["bench", "--json", "--no-s3", *TINY, "--s3", "--s3-endpoint", moto_endpoint, "--s3-trajectories", "1",
                  "--storage-options", json.dumps({"key": "testing", "secret": "testing"})], capsys)
    assert d["s3"]["tokens"] == 48 and d["write_ratio_s3"] > 0 and d["read_ratio_s3"] > 0
    assert d["s3"]["tail_latency_s"] is not None
    # the other commands on an S3 store, options from --storage-options and from the environment
    name, _client, options = s3_bucket
    url = f"s3://{name}/cli"
    _build(url, options).close()
    opts = json.dumps({k: v for k, v in options.items() if k != "skip_instance_cache"})
    got = run_json(["ls", url, "--json", "--storage-options", opts], capsys)
    assert [t["traj_id"] for t in got["trajectories"]] == ["traj-a", "traj-b", "traj-c"]
    env = {**os.environ, "TRACESTORE_STORAGE_OPTIONS": opts}
    r = sub("verify", url, "--json", env=env)
    assert r.returncode == 0 and json.loads(r.stdout)["ok"], r.stderr


# ---------------------------------------------------------------------------------------------- new-user defects
def test_every_option_has_help():
    from tracestore.cli import build_parser

    parser = build_parser()
    missing = []
    for name, sp in [("", parser), *parser.subcommands.items()]:
        for action in sp._actions:
            if action.help is None and action.dest not in ("help", "version"):
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
    assert not missing, missing


@pytest.mark.parametrize("command", COMMANDS)
def test_help_has_examples_named_metavars_and_defaults(command, capsys):
    import argparse

    from tracestore.cli import build_parser

    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    examples = out[out.index("examples:"):].splitlines()[1:]
    assert examples and examples[0].strip().startswith(f"tracestore {command}"), out
    sp = build_parser().subcommands[command]
    for action in sp._actions:
        if not action.option_strings or action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction):
            continue
        flag = action.option_strings[-1]
        assert action.metavar is not None or action.choices is not None, f"{flag} shows {action.dest.upper()}"
        if action.default is not None:
            assert "default" in action.help, f"{flag}: {action.help}"


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"tracestore {ts.__version__}"


def test_unknown_flag_after_a_subcommand_shows_its_usage(built, capsys):
    with pytest.raises(SystemExit) as e:
        main(["ls", built, "--bogus"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "usage: tracestore ls" in err and "--bogus" in err


@pytest.mark.parametrize("argv", [["bench", "--trajectories", "0"], ["bench", "--tokens", "-5"],
                                  ["create", "X", "--sites", "0"], ["show", "X", "t", "--rows", "-1"]])
def test_numbers_checked_at_parse_time(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err and "argument" in err


@pytest.mark.parametrize("url", ["/proc/forbidden/store", "/dev/null/store"])
def test_create_where_no_store_can_live(url, capsys):
    code, _out, err = run(["create", url, "--sites", "1", "--width", "64"], capsys)
    assert code == 2 and "LocationError" in err and "tracestore.json' not found" not in err, err


@pytest.mark.s3
def test_create_in_a_missing_bucket(moto_endpoint, capsys):
    code, _out, err = run(["create", "s3://no-such-bucket-x/s", "--sites", "1", "--width", "64", "--endpoint-url",
                           moto_endpoint], capsys)
    assert code == 2 and "LocationError" in err and "bucket" in err, err


def test_memory_urls_are_refused(capsys):
    code, out, err = run(["create", "memory://x/s", "--sites", "1", "--width", "64"], capsys)
    assert code == 2 and "memory://" in err and "created" not in out


def test_create_exist_ok_says_opened_and_errors_name_the_flag(tmp_path, capsys):
    url = str(tmp_path / "s")
    code, out, _ = run(["create", url, "--sites", "1", "--width", "64"], capsys)
    assert code == 0 and out.startswith("created")
    code, out, _ = run(["create", url, "--sites", "1", "--width", "64", "--exist-ok"], capsys)
    assert code == 0 and out.startswith("opened the existing store")
    code, _out, err = run(["create", url, "--sites", "1", "--width", "64"], capsys)
    assert code == 2 and "--exist-ok" in err and "exist_ok=True" not in err


def test_export_counts_each_record_once(fresh, tmp_path, capsys):
    import pyarrow.parquet as pq

    store = ts.open_store(fresh)
    n_records = sum(len(e) for e in store.read_entries(0, store.head()))
    assert run(["compact", fresh], capsys)[0] == 0
    _commit_more = ts.open_store(fresh)
    with _commit_more.writer("w2", commit_interval_s=0) as w:
        w.write("traj-d", 0, **rows(_commit_more, "traj-d", 0, 8))
    ts.open_store(fresh).log.compact()  # a second checkpoint: each holds the whole log up to its log_end
    checkpoints = sorted(glob.glob(os.path.join(fresh, "index", "*.parquet")))
    assert len(checkpoints) == 2 and pq.read_table(checkpoints[0]).num_rows > 0  # reading both counts twice
    d = run_json(["export", fresh, str(tmp_path / "r.parquet"), "--json"], capsys)
    table = pq.read_table(tmp_path / "r.parquet")
    assert d["records"] == table.num_rows == n_records + 1
    assert sorted(set(table.column("traj_id").to_pylist())) == ["traj-a", "traj-b", "traj-c", "traj-d"]


def test_export_results_table(fresh, tmp_path, capsys):
    """``export --table results``: one row per committed result (the first, if a trajectory had two), in
    traceschemas.result_schema(), with the snapshot in the file; records and results from one snapshot join.
    Before: export wrote records only (no --table)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
    import traceschemas

    with ts.open_store(fresh).writer("w0", commit_interval_s=0) as w:
        w.write_result("traj-a", reward=1.0, group_id="g", prompt_len=10, response_len=60, policy_version=1,
                       finish_reason="stop", extra={"k": [1, 2]})
        w.write_result("traj-b", reward=0.0, group_id="g", prompt_len=5, response_len=20, policy_version=1)
    with ts.open_store(fresh).writer("w1", commit_interval_s=0) as w:
        w.write("traj-e", 0, **rows(ts.open_store(fresh), "traj-e", 0, 4))
        w.write_result("traj-e", reward=0.5, prompt_len=1, policy_version=2, advantage=0.25)
    snap = ts.open_store(fresh).snapshot().to_json()
    d = run_json(["export", fresh, str(tmp_path / "res.parquet"), "--table", "results", "--snapshot", snap,
                  "--json"], capsys)
    assert (d["table"], d["rows"], d["snapshot"]) == ("results", 3, snap)
    table = pq.read_table(tmp_path / "res.parquet")
    assert table.schema.remove_metadata() == traceschemas.result_schema()
    assert json.loads(table.schema.metadata[b"tracestore.snapshot"]) == json.loads(snap)
    assert table.column("traj_id").to_pylist() == ["traj-a", "traj-b", "traj-e"]
    assert json.loads(table.column("extra")[0].as_py()) == {"k": [1, 2]}
    assert table.column("advantage").to_pylist() == [None, None, 0.25]
    mean = table.group_by("policy_version").aggregate([("reward", "mean")]).sort_by("policy_version")
    assert mean.column("reward_mean").to_pylist() == [0.5, 0.5]
    records = run_json(["export", fresh, str(tmp_path / "rec.parquet"), "--snapshot", snap, "--json"], capsys)
    rec = pq.read_table(tmp_path / "rec.parquet")
    assert records["table"] == "records" and records["rows"] == records["records"] == rec.num_rows
    joined = rec.join(table.select(["traj_id", "reward"]), "traj_id", join_type="inner")
    assert set(joined.column("traj_id").to_pylist()) == {"traj-a", "traj-b", "traj-e"}
    assert pc.sum(pc.subtract(joined.column("token_stop"), joined.column("token_start"))).as_py() == 70 + 25 + 4
    code, out, _ = run(["export", fresh, str(tmp_path / "r.parquet"), "--table", "results"], capsys)
    assert code == 0 and out.startswith("wrote 3 results")
    with pytest.raises(SystemExit) as e:
        main(["export", fresh, str(tmp_path / "x.parquet"), "--table", "tokens"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "'tokens'" in err and "'results'" in err and not (tmp_path / "x.parquet").exists()
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    text = capsys.readouterr().out
    assert "--table" in text and "results" in text


def test_readme_store_snippet_runs_on_its_own(tmp_path, monkeypatch):
    text = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    start = text.rindex("```python\n", 0, text.index("tracestore as ts\n", text.index("## The store")))
    code = text[start + len("```python\n"): text.index("```", start + 10)]
    monkeypatch.chdir(tmp_path)
    exec(compile(code.replace("/tmp/hints", str(tmp_path / "hints")), "README", "exec"), {})
