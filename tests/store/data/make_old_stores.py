"""Write the format-1 and format-2 stores under ``tests/store/data/`` with the tracestore of commit 42469c1 (the
last code that wrote format 2 by default), so that tests/store/test_old_stores.py reads bytes that older code
wrote, not this code's own version-2 path. Run from a checkout of that commit:

    git worktree add --detach /tmp/old 42469c1
    PYTHONPATH=<dir with tracefp4 -> /tmp/old/kernels, traceschemas -> /tmp/old/schemas>:/tmp/old:/tmp/old/tests \\
        python tests/store/data/make_old_stores.py tests/store/data
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import tracestore as ts
import tracestore.commit_log as commit_log
from helpers.store import rows

SITES = [ts.Site("s0", 64), ts.Site("s1", 128, fp4_format="mxfp4")]


def build(root: Path, version: int) -> None:
    url = str(root / f"format_v{version}")
    shutil.rmtree(url, ignore_errors=True)
    store = ts.create_store(url, SITES, moe_layers=["m0"], top_k=2, num_experts=8, chunk_rows=4, shard_bytes=256,
                            format_version=version, model={"name": "tiny"})
    with store.writer("w", commit_interval_s=0) as w:
        w.write("t0", 0, **rows(store, "t0", 0, 10))
        w.write("t1", 0, **rows(store, "t1", 0, 6, policy_version=1))
        w.flush()
        w.write("t1", 6, **rows(store, "t1", 6, 9, policy_version=1))
        if version >= 2:
            w.write_result("t0", reward=1.5, group_id="g0", advantage=0.25, prompt_len=4, response_len=6,
                           policy_version=0, finish_reason="stop", extra={"k": [1, "é"]})
            w.write_result("t1", reward=-1.0, group_id="g0", prompt_len=3, response_len=6, policy_version=1)
            w.write_result("empty", reward=0.0, finish_reason="abort")  # format 2 allowed a result without tokens
    commit_log.CHECKPOINT_MIN_ENTRIES = 1  # a checkpoint of these few entries
    assert store.compact() == store.head()
    with store.writer("w2", commit_interval_s=0) as w:  # one entry after the checkpoint
        w.write("t2", 0, **rows(store, "t2", 0, 5, policy_version=2))
    crashed = store.writer("crashed", commit_interval_s=0)  # a segment written and never committed
    crashed.write("x", 0, **rows(store, "x", 0, 4))
    crashed._committer.write_segment(crashed._buffer.take())


if __name__ == "__main__":
    out = Path(sys.argv[1])
    for v in (1, 2):
        build(out, v)
