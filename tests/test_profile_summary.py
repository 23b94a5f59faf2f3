"""benchmarks/profile_summary.py's host view: per thread the time inside top-level operations, and for the first
thread the time between its operations grouped by the operations around it (where a GIL stall shows up)."""

from __future__ import annotations

import gzip
import json
from helpers import benchmarks


def _module():
    return benchmarks.load("profile_summary")


def _op(tid, name, ts, dur, cat="cpu_op"):
    return {"ph": "X", "cat": cat, "tid": tid, "name": name, "ts": ts, "dur": dur}


def test_host_gaps_are_grouped_by_the_operations_around_them(tmp_path, capsys):
    ps = _module()
    events = [
        # the main thread: three layers of (argsort, 1.5 ms gap, empty_like), a nested op that is not top-level
        *[e for i in range(3) for e in (_op(1, "aten::argsort", 10_000 * i, 100),
                                        _op(1, "aten::empty_like", 10_000 * i + 1_600, 50),
                                        _op(1, "aten::empty", 10_000 * i + 1_610, 10))],
        _op(1, "cuLaunchKernelEx", 25_000, 20, cat="cuda_driver"),
        # the backward's thread, later
        _op(2, "MmBackward0", 30_000, 400), _op(2, "MulBackward0", 30_500, 100),
        # device events are not host time
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 500},
    ]
    h = ps.host_summary(events, top=2)
    main = h["main"]
    assert main["tid"] == 1 and [t["tid"] for t in h["threads"]] == [1, 2]
    assert h["threads"][0]["in_ops_ms"] == round((3 * 150 + 20) / 1e3, 2)  # the nested aten::empty not counted
    assert h["threads"][1] == {"tid": 2, "from_ms": 30.0, "span_ms": 0.6, "in_ops_ms": 0.5}
    first = main["largest_gaps"][0]
    assert (first["after"], first["before"], first["count"]) == ("aten::empty_like", "aten::argsort", 2)
    counts = {(g["after"], g["before"]): g["count"] for g in main["largest_gaps"]}
    assert counts[("aten::argsort", "aten::empty_like")] == 3
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    assert ps.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "between its ops" in out and "after aten::argsort / before aten::empty_like" in out


def test_host_waits_name_the_operation_that_waited(tmp_path):
    ps = _module()
    events = [
        _op(1, "aten::to", 1_000, 7_100), _op(1, "aten::_to_copy", 1_010, 7_080), _op(1, "aten::copy_", 1_020, 7_060),
        _op(1, "cudaMemcpyAsync", 1_030, 7_000, cat="cuda_runtime"),  # a .cpu() that waited 7 ms
        _op(1, "cudaMemcpyAsync", 9_000, 100, cat="cuda_runtime"),  # a short one: not listed
        _op(1, "cudaDeviceSynchronize", 20_000, 27_000, cat="cuda_runtime"),  # outside any torch op
        _op(2, "aten::item", 5_000, 3_000), _op(2, "cudaStreamSynchronize", 5_010, 2_900, cat="cuda_runtime"),
    ]
    waits = ps.host_waits(events)
    assert [(w["call"], w["tid"], w["in"]) for w in waits] == [
        ("cudaMemcpyAsync", 1, ["aten::to", "aten::_to_copy", "aten::copy_"]),
        ("cudaStreamSynchronize", 2, ["aten::item"]),
        ("cudaDeviceSynchronize", 1, [])]
    assert waits[0]["at_ms"] == 0.03 and waits[0]["ms"] == 7.0 and waits[2]["ms"] == 27.0
    trace = tmp_path / "t.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": events + [{"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 500}]}, f)
    assert ps.summarize(str(trace))["host_waits"] == waits
