"""Randomized fault runs of the store on S3 (moto server behind the fault-injecting proxy of the test suite):
a writer, a tailing reader and gc work in parallel while the proxy answers a share of requests with 503
SlowDown, resets connections before or after applying them, answers 500 after applying them, or delays them.

Each run checks, with the faults off afterwards, that nothing committed was lost, duplicated, hidden from the
tail or reported as a lost race, and that gc deleted no committed segment (``tests/helpers/faults.chaos_run``).
Prints a table and saves JSON (default ``benchmarks/results/store-faults-<arch>-<n>cpu.json``).

Usage: python3 benchmarks/benchmark_store_faults.py [--runs 3] [--trajectories 40] [--tokens 160] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from tracestore.cli.argtypes import positive_int  # noqa: E402
from tracestore.cli.bench import machine_info, machine_name  # noqa: E402

RATES = {"error": 0.04, "reset": 0.02, "apply_error": 0.02, "apply_reset": 0.02, "delay": 0.02}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=positive_int, default=3, help="runs, each with its own seed (default 3)")
    p.add_argument("--trajectories", type=positive_int, default=40, help="trajectories per run (default 40)")
    p.add_argument("--tokens", type=positive_int, default=160, help="tokens per trajectory (default 160)")
    p.add_argument("--seed", type=int, default=100, help="seed of the first run (default 100)")
    p.add_argument("--smoke", action="store_true", help="one tiny run (seconds) to check the program")
    p.add_argument("--out", help="JSON file (default benchmarks/results/store-faults-<machine>.json)")
    args = p.parse_args(argv)
    if args.smoke:
        args.runs, args.trajectories, args.tokens = 1, 3, 48
    logging.basicConfig(level=logging.ERROR)

    import os

    import boto3
    import s3fs

    import conftest  # the suite's moto setup: dummy credentials, atomic conditional PUTs
    from helpers.faults import FaultProxy, chaos_run
    from moto.server import ThreadedMotoServer

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    conftest._make_conditional_put_atomic()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    s3fs.S3FileSystem.retries = 1  # every fault reaches tracestore (botocore's retries are off in the options)
    port = conftest._free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    runs = []
    try:
        for k in range(args.runs):
            bucket = f"faults-{uuid.uuid4().hex[:12]}"
            boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
            with FaultProxy(endpoint, seed=args.seed + k) as proxy:
                t0 = time.monotonic()
                out = chaos_run(f"s3://{bucket}/run", proxy.storage_options(), proxy, trajectories=args.trajectories,
                                tokens=args.tokens, rates=RATES, seed=args.seed + k)
                out["wall_s"] = round(time.monotonic() - t0, 1)
            runs.append(out)
            c = out["counts"]
            faults = sum(v for key, v in c.items() if key.startswith("faults."))
            print(f"run {k + 1}/{args.runs}: {c['requests']} requests, {faults} faults, {c['log_entries']} commits, "
                  f"{len(out['problems'])} problems", flush=True)
    finally:
        server.stop()

    def med(key: str) -> tuple[float, float, float]:
        vals = [r["counts"].get(key, 0) for r in runs]
        return statistics.median(vals), min(vals), max(vals)

    rows = [("requests through the proxy", "requests"), ("injected: 503 SlowDown", "faults.error"),
            ("injected: reset before applying", "faults.reset"), ("injected: 500 after applying", "faults.apply_error"),
            ("injected: reset after applying", "faults.apply_reset"), ("injected: delay", "faults.delay"),
            ("log entries committed", "log_entries"), ("records", "records"), ("writer retries", "writer_retries"),
            ("reader retries", "reader_retries"), ("gc runs", "gc_runs"), ("gc refusals", "gc_refused"),
            ("gc storage errors", "gc_storage_errors"), ("gc deleted orphan segments", "gc_deleted_segments"),
            ("lost races reported", "lost_races"), ("seconds", "seconds")]
    print(f"\n{'what':<34} {'median':>9} {'min':>9} {'max':>9}")
    for name, key in rows:
        m, lo, hi = med(key)
        print(f"{name:<34} {m:>9g} {lo:>9g} {hi:>9g}")
    problems = [p for r in runs for p in r["problems"]]
    print(f"\nproblems (lost, duplicated, hidden, false conflicts, wrong bytes): {len(problems)}")
    for line in problems[:10]:
        print("  ", line)
    result = {"benchmark": "store-faults", "machine": machine_info(), "rates": RATES,
              "config": {"runs": args.runs, "trajectories": args.trajectories, "tokens": args.tokens,
                         "seed": args.seed},
              "versions": _versions(), "runs": runs, "problems": len(problems)}
    if not args.smoke or args.out:
        out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"store-faults-{machine_name()}.json"
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"saved {out}")
    return 1 if problems else 0


def _versions() -> dict:
    from importlib import metadata

    out = {"python": sys.version.split()[0]}
    for name in ("tracestore", "s3fs", "aiobotocore", "botocore", "moto", "fsspec"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


if __name__ == "__main__":
    sys.exit(main())
