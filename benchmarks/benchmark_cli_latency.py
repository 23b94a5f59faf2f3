"""How fast ``tracestore`` and ``tracerl`` answer ``--help``, ``--version``, bad arguments and missing stores: the
wall time of each command line in a fresh interpreter (``python -m tracestore.cli`` / ``python -m tracerl.cli``, what
the console scripts run), and what it imports (``python -X importtime``). Goal (issue 22): under 1 s on an idle
2-core machine, i.e. no torch (1-3 s alone), and no numpy / pyarrow / zarr where nothing needs them.

Each case runs once to warm the page cache and the bytecode, then ``--runs`` times (median, min..max); then once
under ``-X importtime``, whose top modules by cumulative time go to ``<out>-importtime.txt`` beside the JSON. The
JSON records the machine, the package versions, the measured tree's commit and the load average before and after
(the machine may be shared: compare runs at similar load).

    python benchmarks/benchmark_cli_latency.py                      # every case, 5 runs -> results/cli-latency.json
    python benchmarks/benchmark_cli_latency.py --smoke              # 3 cases, 3 runs, results in a temp folder
    python benchmarks/benchmark_cli_latency.py --repo /tmp/old --label before --out /tmp/before.json
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
#: modules a command should import only once it runs
HEAVY = ("torch", "pyarrow", "numpy", "zarr", "s3fs", "fsspec", "rich", "matplotlib", "transformers", "triton")
VERSIONS = ("torch", "pyarrow", "numpy", "zarr", "s3fs", "fsspec", "rich", "matplotlib", "transformers", "triton")
GOAL_S = 1.0

TS, RL = "tracestore.cli", "tracerl.cli"
# (name, module or None for `python -c`, argv, expected exit code); {tmp}, {full}, {store}, {ck} are places below
CASES: list[tuple[str, str | None, list[str], int]] = [
    ("python -c pass (floor)", None, ["pass"], 0),
    ("python -c 'import torch' (what a torch import costs)", None, ["import torch"], 0),
    ("tracestore --help", TS, ["--help"], 0),
    ("tracestore --version", TS, ["--version"], 0),
    ("tracestore info --help", TS, ["info", "--help"], 0),
    ("tracestore bench --help", TS, ["bench", "--help"], 0),
    ("tracestore gc URL --grace -1 (bad value)", TS, ["gc", "{tmp}/s", "--grace", "-1"], 2),
    ("tracestore create NEW (no sites)", TS, ["create", "{tmp}/new"], 2),
    ("tracestore info /nonexistent", TS, ["info", "{tmp}/nonexistent"], 2),
    ("tracestore verify /nonexistent", TS, ["verify", "{tmp}/nonexistent"], 2),
    ("tracestore ls <dir without a store>", TS, ["ls", "{full}"], 2),
    ("tracestore export /nonexistent OUT", TS, ["export", "{tmp}/nonexistent", "{tmp}/out.parquet"], 2),
    ("tracestore info STORE (success, for scale)", TS, ["info", "{store}"], 0),
    ("tracerl --help", RL, ["--help"], 0),
    ("tracerl --version", RL, ["--version"], 0),
    ("tracerl demo --help", RL, ["demo", "--help"], 0),
    ("tracerl train --help", RL, ["train", "--help"], 0),
    ("tracerl demo --trajectories 0 (bad value)", RL, ["demo", "--trajectories", "0"], 2),
    ("tracerl demo --hidden 40", RL, ["demo", "--hidden", "40"], 2),
    ("tracerl demo --store <non-empty dir>", RL, ["demo", "--store", "{full}"], 2),
    ("tracerl audit not-a-store", RL, ["audit", "{tmp}/not-a-store"], 2),
    ("tracerl train --store /nonexistent (usage)", RL, ["train", "--store", "{tmp}/nonexistent"], 2),
    ("tracerl train /nonexistent --checkpoints C", RL, ["train", "{tmp}/nonexistent", "--checkpoints", "{tmp}/c"], 2),
    ("tracerl rollout /nonexistent", RL, ["rollout", "{tmp}/nonexistent"], 2),
    ("tracerl replay /nonexistent --from C", RL, ["replay", "{tmp}/nonexistent", "--from", "{tmp}/c"], 2),
    ("tracerl replay STORE --from <no checkpoints>", RL, ["replay", "{store}", "--from", "{ck}"], 2),
    ("tracerl set-aside <no checkpoints>", RL, ["set-aside", "{ck}"], 2),
    ("tracerl loop --task copy (response > prompt)", RL,
     ["loop", "--dir", "{tmp}/run", "--task", "copy", "--prompt-len", "4", "--response-len", "8"], 2),
    ("tracerl loop --store STORE (exists already)", RL, ["loop", "--dir", "{tmp}/run", "--store", "{store}"], 2),
]
SMOKE = ("tracestore --help", "tracerl --help", "tracerl train /nonexistent --checkpoints C")


def _places(tmp: Path, env: dict) -> dict:
    """The folders the cases name: a directory with a file (no store), an empty store, an empty checkpoint folder."""
    (tmp / "full").mkdir()
    (tmp / "full" / "notes.txt").write_text("x")
    (tmp / "ck").mkdir()
    subprocess.run([sys.executable, "-m", TS, "create", str(tmp / "store"), "--sites", "2", "--width", "64"],
                   check=True, capture_output=True, env=env, cwd=tmp, timeout=300)
    return {"tmp": str(tmp), "full": str(tmp / "full"), "store": str(tmp / "store"), "ck": str(tmp / "ck")}


def _env(repo: Path, alias: Path) -> dict:
    """The measured tree first on the path, with the import names the package installs its folders under
    (tracefp4 = kernels/, traceschemas = schemas/) as links beside it."""
    for name, folder in (("tracefp4", "kernels"), ("traceschemas", "schemas")):
        link = alias / name
        if not link.exists():
            link.symlink_to(repo / folder, target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k not in ("TRACESTORE_STORAGE_OPTIONS", "PYTHONSTARTUP")}
    env["PYTHONPATH"] = os.pathsep.join([str(alias), str(repo), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def _command(module: str | None, argv: list[str], places: dict, importtime: bool = False) -> list[str]:
    args = [a.format(**places) for a in argv]
    head = [sys.executable, *(["-X", "importtime"] if importtime else [])]
    return [*head, "-c", *args] if module is None else [*head, "-m", module, *args]


def _time(cmd: list[str], env: dict, cwd: Path) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=600)
    return time.perf_counter() - t0, p


_IMPORT_LINE = re.compile(r"^import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)\s*$")


def _importtime(stderr: str) -> list[dict]:
    """``-X importtime`` lines -> [{module, self_us, cumulative_us, depth}] in the order printed."""
    rows = []
    for line in stderr.splitlines():
        m = _IMPORT_LINE.match(line)
        if m:
            rows.append({"module": m.group(4), "self_us": int(m.group(1)), "cumulative_us": int(m.group(2)),
                         "depth": len(m.group(3)) // 2})
    return rows


def _heavy(rows: list[dict]) -> dict[str, float]:
    """Heavy packages imported -> the largest cumulative import time of the package or one of its modules, in
    seconds (``import rich.console`` imports the small package ``rich`` first, then the rest)."""
    out: dict[str, float] = {}
    for r in rows:
        top = r["module"].split(".")[0]
        if top in HEAVY:
            out[top] = max(out.get(top, 0.0), r["cumulative_us"] / 1e6)
    return out


def _versions() -> dict:
    out = {}
    for name in VERSIONS:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _commit(repo: Path) -> dict:
    def git(*a):
        p = subprocess.run(["git", "-C", str(repo), *a], capture_output=True, text=True)
        return p.stdout.strip() if p.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(status) if status is not None else None}


def _loadavg() -> list[float] | None:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5, help="timed runs per case, at least 3 (default 5)")
    ap.add_argument("--top", type=int, default=12, help="modules per case in the importtime table (default 12)")
    ap.add_argument("--repo", type=Path, default=REPO, help="source tree whose commands are timed (default: this one)")
    ap.add_argument("--label", default="", help="a name for the measured tree (e.g. before, after)")
    ap.add_argument("--out", type=Path, help="JSON path (default results/cli-latency.json; --smoke: a temp folder)")
    ap.add_argument("--smoke", action="store_true", help=f"only {len(SMOKE)} cases, 3 runs (checks the code paths)")
    args = ap.parse_args(argv)
    if args.runs < 3:
        ap.error("--runs must be >= 3 (a median and a spread)")
    runs = 3 if args.smoke else args.runs
    cases = [c for c in CASES if c[0] in SMOKE] if args.smoke else CASES
    scratch = Path(tempfile.mkdtemp(prefix="cli-latency-"))
    out = args.out or (scratch / "cli-latency.json" if args.smoke else HERE / "results" / "cli-latency.json")
    repo = args.repo.resolve()
    (scratch / "alias").mkdir()
    env = _env(repo, scratch / "alias")
    work = scratch / "work"
    work.mkdir()
    places = _places(work, env)
    load_before = _loadavg()
    print(f"tree {repo} {args.label}; {platform.python_version()}, {os.cpu_count()} CPUs, load {load_before}; "
          f"{runs} runs per case", flush=True)
    results, tables = [], []
    for name, module, case_argv, want in cases:
        cmd = _command(module, case_argv, places)
        _time(cmd, env, work)  # warm-up: page cache, bytecode
        times, rcs, first = [], set(), ""
        for _ in range(runs):
            dt, p = _time(cmd, env, work)
            times.append(dt)
            rcs.add(p.returncode)
            first = (p.stderr.strip().splitlines() or [""])[-1][:160]
        _, pi = _time(_command(module, case_argv, places, importtime=True), env, work)
        rows = _importtime(pi.stderr)
        heavy = _heavy(rows)
        top = sorted(rows, key=lambda r: -r["cumulative_us"])[: args.top]
        med = statistics.median(times)
        r = {"case": name, "argv": ([] if module is None else ["-m", module]) + case_argv, "expected_rc": want,
             "rc": sorted(rcs), "ok_rc": rcs == {want}, "runs_s": [round(t, 4) for t in times],
             "median_s": round(med, 4), "min_s": round(min(times), 4), "max_s": round(max(times), 4),
             "goal_applies": module is not None and "(success" not in name, "under_goal": med < GOAL_S, "heavy_imported_s": {k: round(v, 4) for k, v in heavy.items()},
             "modules_imported": len(rows), "stderr_last_line": first,
             "importtime_top": [{k: r_[k] for k in ("module", "self_us", "cumulative_us")} for r_ in top]}
        results.append(r)
        flag = "" if r["ok_rc"] else f"  UNEXPECTED rc {sorted(rcs)} (want {want})"
        print(f"{name:<55} {med:7.3f} s  ({min(times):.3f}..{max(times):.3f})  rc {sorted(rcs)}  "
              f"heavy: {', '.join(heavy) or '-'}{flag}", flush=True)
        lines = [f"## {name}", f"   {' '.join(_command(module, case_argv, places, importtime=True)[1:])}",
                 f"   {len(rows)} modules; heavy: "
                 + (", ".join(f"{k} {v:.3f}s" for k, v in heavy.items()) or "none"),
                 f"   {'self ms':>9} {'cumul. ms':>10}  module (top {args.top} by cumulative time)"]
        lines += [f"   {t['self_us'] / 1e3:9.1f} {t['cumulative_us'] / 1e3:10.1f}  {t['module']}" for t in top]
        tables.append("\n".join(lines))
    load_after = _loadavg()
    over = [r["case"] for r in results if r["goal_applies"] and not r["under_goal"]]
    goal = [r for r in results if r["goal_applies"]]
    print(f"\n{sum(r['under_goal'] for r in goal)} of {len(goal)} command cases under {GOAL_S:g} s (median); "
          f"commands over it: {over or 'none'}; load average before {load_before}, after {load_after}")
    result = {
        "benchmark": "cli_latency", "label": args.label, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "tree": {"path": str(repo), **_commit(repo)}, "runs_per_case": runs, "goal_s": GOAL_S,
        "how": "wall time of `python -m MODULE ARGS` in a fresh interpreter (what the console scripts run), after "
               "one warm-up run; importtime from one more run under -X importtime",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "cpu_model": _cpu_model(),
                    "python": platform.python_version(), "executable": sys.executable,
                    "loadavg_1_5_15_before": load_before, "loadavg_1_5_15_after": load_after},
        "versions": _versions(), "cases": results, "over_goal": over,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    table_path = out.with_name(out.stem + "-importtime.txt")
    table_path.write_text(f"python -X importtime per case ({args.label or repo}, load {load_before}); "
                          f"microsecond columns of importtime shown in ms\n\n" + "\n\n".join(tables) + "\n")
    print(f"wrote {out} and {table_path}")
    return 0 if all(r["ok_rc"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
