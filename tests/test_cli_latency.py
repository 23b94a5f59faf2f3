"""`tracestore` and `tracerl` answer ``--help``, ``--version``, bad arguments and missing stores without loading the
heavy modules a command needs only once it runs (torch alone took 1-3 s of every such answer, tens of seconds on a
busy 2-core machine). Structural, not timed: each case runs the real command line in a fresh interpreter and lists
the heavy modules in ``sys.modules`` at its exit (benchmarks/benchmark_cli_latency.py times them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: what a command imports only when it runs
HEAVY = ("torch", "pyarrow", "numpy", "zarr", "s3fs", "rich", "matplotlib", "transformers")

#: runs ``python -m MODULE ARGS...`` (as the console scripts do) and writes the heavy modules loaded at exit to a file
_DRIVER = """
import atexit, json, runpy, sys
out, heavy, module = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
def report():
    with open(out, "w") as f:
        json.dump(sorted(m for m in heavy if m in sys.modules), f)
atexit.register(report)
sys.argv = [module, *sys.argv[4:]]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def _run(module: str, argv: list[str], tmp_path) -> tuple[subprocess.CompletedProcess, list[str]]:
    out = tmp_path / "loaded.json"
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("TRACESTORE_STORAGE_OPTIONS", None)
    p = subprocess.run([sys.executable, "-c", _DRIVER, str(out), json.dumps(HEAVY), module, *argv],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    return p, json.loads(out.read_text())


@pytest.fixture
def places(tmp_path):
    """{tmp}: a scratch folder; {full}: a directory with a file in it (no store); {store}: an empty store."""
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("x")
    import tracestore as ts

    ts.create_store(str(tmp_path / "store"), [ts.Site("s0", 64)]).close()
    (tmp_path / "no-checkpoints").mkdir()
    return {"tmp": str(tmp_path), "full": str(tmp_path / "full"), "store": str(tmp_path / "store")}


def _fmt(argv, places):
    return [a.format(**places) for a in argv]


TRACERL_COMMANDS = ["demo", "train", "rollout", "loop", "replay", "audit", "set-aside"]
TRACESTORE_COMMANDS = ["create", "info", "ls", "show", "tail", "verify", "gc", "compact", "export", "bench"]

HELP_CASES = ([("tracerl.cli", ["--help"]), ("tracerl.cli", ["--version"])]
              + [("tracerl.cli", [c, "--help"]) for c in TRACERL_COMMANDS]
              + [("tracestore.cli", ["--help"]), ("tracestore.cli", ["--version"])]
              + [("tracestore.cli", [c, "--help"]) for c in TRACESTORE_COMMANDS])


@pytest.mark.parametrize("module, argv", HELP_CASES, ids=[" ".join([m.split(".")[0], *a]) for m, a in HELP_CASES])
def test_help_and_version_load_nothing_heavy(module, argv, tmp_path):
    p, loaded = _run(module, argv, tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() and not loaded, loaded


# (module, argv, the one stderr line contains, heavy modules it may load)
ERROR_CASES = [
    # argparse: bad option values, missing arguments, unknown options
    ("tracerl.cli", ["demo", "--trajectories", "0"], "must be >= 1", ()),
    ("tracerl.cli", ["train", "{tmp}/s", "--checkpoints", "{tmp}/c", "--lr", "-1"], "must be a finite number > 0", ()),
    ("tracerl.cli", ["train", "--store", "/nonexistent"], "required", ()),
    ("tracerl.cli", ["rollout", "{tmp}/s", "--group-size", "1"], "must be >= 2", ()),
    ("tracerl.cli", ["loop", "--steps", "0"], "must be >= 1", ()),
    ("tracerl.cli", ["replay", "{tmp}/s"], "--from", ()),
    ("tracerl.cli", ["audit", "{tmp}/s", "--bands", "x"], "expected an integer", ()),
    ("tracerl.cli", ["set-aside", "{tmp}/c", "--reason", "nope"], "invalid choice", ()),
    ("tracerl.cli", ["audit", "{tmp}/s", "--nope"], "unrecognized arguments", ()),
    ("tracestore.cli", ["gc", "{tmp}/s", "--grace", "-1"], "must be a finite number > 0", ()),
    ("tracestore.cli", ["ls", "{tmp}/s", "--limit", "x"], "expected an integer", ()),
    ("tracestore.cli", ["bench", "--trajectories", "0"], "", ()),
    ("tracestore.cli", ["nope"], "invalid choice", ()),
    # options the commands check before they load anything
    ("tracerl.cli", ["demo", "--hidden", "40"], "multiple of 16", ()),
    ("tracerl.cli", ["demo", "--hint-layers", "0,99"], "out of range", ()),
    ("tracerl.cli", ["audit", "{tmp}/s", "--storage-options", "{{bad"], "UsageError: --storage-options: not valid JSON",
     ()),
    ("tracerl.cli", ["audit", "{store}", "--html", "{tmp}/nope/r.html"], "does not exist", ()),
    ("tracerl.cli", ["loop", "--dir", "{full}/notes.txt"], "is not a directory", ("numpy",)),
    ("tracerl.cli", ["loop", "--dir", "{tmp}/run", "--task", "copy", "--prompt-len", "4", "--response-len", "8"],
     "response_len=8 > prompt_len=4", ("numpy",)),
    ("tracerl.cli", ["loop", "--dir", "{tmp}/run", "--hint-layers", "0,99"], "out of range", ("numpy",)),
    # a local path without a store: said at once, without numpy, pyarrow or zarr
    ("tracerl.cli", ["audit", "{tmp}/not-a-store"], "StoreNotFoundError: no tracestore store at", ()),
    ("tracerl.cli", ["train", "{tmp}/not-a-store", "--checkpoints", "{tmp}/c"], "StoreNotFoundError", ()),
    ("tracerl.cli", ["rollout", "{tmp}/not-a-store"], "StoreNotFoundError", ()),
    ("tracerl.cli", ["replay", "{tmp}/not-a-store", "--from", "{tmp}/c"], "StoreNotFoundError", ()),
    ("tracestore.cli", ["info", "{tmp}/not-a-store"], "StoreNotFoundError: no tracestore store at", ()),
    ("tracestore.cli", ["ls", "{full}"], "StoreNotFoundError", ()),
    ("tracestore.cli", ["show", "{tmp}/not-a-store", "t0"], "StoreNotFoundError", ()),
    ("tracestore.cli", ["tail", "{tmp}/not-a-store", "--timeout", "0"], "StoreNotFoundError", ()),
    ("tracestore.cli", ["verify", "{tmp}/not-a-store"], "StoreNotFoundError", ()),
    ("tracestore.cli", ["gc", "{tmp}/not-a-store", "--dry-run"], "StoreNotFoundError", ()),
    ("tracestore.cli", ["compact", "{tmp}/not-a-store"], "StoreNotFoundError", ()),
    ("tracestore.cli", ["export", "{tmp}/not-a-store", "{tmp}/out.parquet"], "StoreNotFoundError", ()),
    # errors found by opening a store (tracestore's modules load, torch does not)
    ("tracerl.cli", ["demo", "--store", "{full}"], "ConfigError: store ", ("numpy", "pyarrow", "zarr")),
    ("tracerl.cli", ["demo", "--store", "{store}"], "exists there already", ("numpy", "pyarrow", "zarr")),
    ("tracerl.cli", ["loop", "--store", "{store}", "--dir", "{tmp}/run"], "exists there already",
     ("numpy", "pyarrow", "zarr")),
    ("tracerl.cli", ["replay", "{store}", "--from", "{tmp}/no-checkpoints"], "CheckpointNotFoundError",
     ("numpy", "pyarrow", "zarr")),
    ("tracerl.cli", ["replay", "{store}", "--from", "{tmp}/no-checkpoints", "--log", "{tmp}/m.jsonl"],
     "CheckpointNotFoundError", ("numpy", "pyarrow", "zarr")),
    ("tracerl.cli", ["set-aside", "{tmp}/no-checkpoints"], "CheckpointNotFoundError", ("numpy", "pyarrow", "zarr")),
    ("tracerl.cli", ["train", "{store}", "--checkpoints", "{tmp}/c", "--cursor", "v1:not-a-cursor"], "cursor",
     ("numpy", "pyarrow", "zarr")),
    ("tracestore.cli", ["info", "{full}/notes.txt"], "LocationError", ("numpy", "pyarrow", "zarr")),
]


@pytest.mark.parametrize("module, argv, message, allowed", ERROR_CASES,
                         ids=[" ".join([m.split(".")[0], *a]) for m, a, _, _ in ERROR_CASES])
def test_argument_and_store_errors_answer_before_heavy_imports(module, argv, message, allowed, places, tmp_path):
    """One line on stderr, exit 2, and none of the heavy modules but ``allowed`` (never torch nor transformers)."""
    p, loaded = _run(module, _fmt(argv, places), tmp_path)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2, p.stderr
    assert message in lines[-1], p.stderr
    if not p.stderr.startswith("usage:"):  # argparse prints the usage above its one line
        assert len(lines) == 1, p.stderr
    assert set(loaded) <= set(allowed), loaded
    assert not {"torch", "transformers"} & set(loaded)


@pytest.mark.parametrize("url", ["{tmp}/nothing", "{full}", "file://{tmp}/nothing", "{full}/notes.txt",
                                 "{full}/notes.txt/below", "{store}", "s3://bucket/nothing"])
def test_the_quick_store_check_agrees_with_open_store(url, places):
    """`check_local_store` refuses exactly the local URLs that `open_store` answers with StoreNotFoundError, with its
    message; anything else it leaves to open_store."""
    import tracestore as ts
    from tracestore.cliargs import MANIFEST_NAME, check_local_store
    from tracestore.format.keys import MANIFEST_KEY

    assert MANIFEST_NAME == MANIFEST_KEY
    url = url.format(**places)
    try:
        check_local_store(url)
        quick = None
    except ts.StoreNotFoundError as e:
        quick = str(e)
    if url.startswith("s3://"):
        assert quick is None
        return
    try:
        ts.open_store(url).close()
        full = None
    except ts.StoreNotFoundError as e:
        full = str(e)
    except ts.TraceStoreError:
        full = None  # another error (a file on the way): the quick check leaves it to open_store
    assert quick == full
    assert check_local_store(url, {"fsync": True}) is None  # with storage options open_store decides
