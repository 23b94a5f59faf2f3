"""Store benchmark: bytes per token, write/read throughput against plain files and plain S3 objects, tail latency.

``run_bench(BenchConfig(...))`` returns one JSON-able dict; ``tracestore bench`` and
``benchmarks/benchmark_store.py`` call it. What is measured (every timing is the median of ``repeats`` runs):

* **bytes per token** (``info`` of the benchmark store): ``payload`` (hint + scale shards), ``trace`` (token ids,
  log-probs, routed experts), ``index_log`` (zarr metadata, log entries, log checkpoints, manifest), reported
  separately, with two overhead definitions: ``overhead_payload`` = (payload + index_log) / logical payload - 1
  (framing cost of the hints: crc32c per inner chunk, shard index, metadata, log) and ``overhead_total`` = all
  stored bytes / logical (payload + trace) - 1.
* **write ratio** = plain time / store time for the same logical bytes: the store writes ``trajectories`` x
  ``tokens`` rows through a :class:`~tracestore.Writer` (``write_tokens`` tokens per ``write`` call, commits
  of ``commit_bytes``; timed from the first write to ``close``); the plain baseline then writes, from one
  preallocated buffer, exactly the objects the store produced (same count, same sizes, same directories),
  one plain ``open().write()`` per file (local) or one s3fs ``pipe`` per segment's objects (S3, as
  concurrent as the store's ``put_many``); the side that writes first alternates between repeats. So the ratio isolates tracestore's own work: validation, the copy
  into the write buffer, crc32c, shard index, log commit.
* **read ratio** = plain time / store time: the store reads every trajectory in full with
  :meth:`Reader.read` (numpy, trace included, crc32c checked; index built from the log inside the timing),
  dropping each batch before the next read as a trainer consuming micro-batches does (so the reader recycles
  the previous batch's output memory; a batch that is kept is never overwritten); the plain baseline reads
  every file it wrote into a fresh numpy array (``np.fromfile`` / s3fs ``cat`` per segment group). Both read
  data written just before (local: from the page cache, both alike). The store shares a large local read
  among ``LocalBackend.read_threads`` threads; the plain baseline reads on one thread, so
  ``read_ratio_vs_threaded_plain`` also compares with plain reads on that many threads (the store's own
  overhead when both use the cores).
  ``read_amplification`` = bytes the store fetched / logical bytes (whole inner chunks at trajectory ends).
* **tail latency**: a :class:`~tracestore.Stream` tailing in a thread (default poll interval) while a writer
  commits small records at random intervals; latency = time seen - the entry's ``created_unix`` (set just
  before the log put), median and p95.

S3 runs against ``s3_endpoint``, or a moto server this module starts in a subprocess on 127.0.0.1 (free port).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from .argtypes import nonneg_int, positive_int
from ..maintenance import info
from ..storage._local import LocalBackend, even_runs
from ..store import Site, create_store

__all__ = ["BenchConfig", "run_bench", "summary_rows", "to_json", "machine_info", "machine_name", "MotoServer",
           "add_arguments", "config_from_args", "DEFAULT_SITES", "DEFAULT_WIDTH"]

log = logging.getLogger(__name__)

#: Qwen3.5-35B-A3B default table: 20 hinted sites of 2048 NVFP4 values, 40 MoE layers routing top-8 of 256
DEFAULT_SITES = 20
DEFAULT_WIDTH = 2048
DEFAULT_MOE_LAYERS = 40
DEFAULT_TOP_K = 8
DEFAULT_NUM_EXPERTS = 256

Progress = Callable[[str, int, int], None]  # (phase, done, total)


@dataclass
class BenchConfig:
    """Benchmark size and options (see the module docstring for what each phase measures)."""

    trajectories: int = 16
    tokens: int = 2048  # per trajectory
    sites: int = DEFAULT_SITES
    width: int = DEFAULT_WIDTH
    fp4_format: str = "nvfp4"
    moe_layers: int = DEFAULT_MOE_LAYERS
    top_k: int = DEFAULT_TOP_K
    num_experts: int = DEFAULT_NUM_EXPERTS
    write_tokens: int = 2048  # tokens per Writer.write call (tracerl's recorder writes pieces of flush_tokens=2048)
    commit_bytes: int = 64 << 20
    chunk_rows: int | None = None  # None: the store default
    shard_bytes: int | None = None
    repeats: int = 3
    url: str | None = None  # local bench directory; None: a temporary directory (removed afterwards)
    s3: bool = True
    s3_endpoint: str | None = None  # None: start a moto server
    s3_bucket: str = "tracestore-bench"
    s3_storage_options: dict | None = None
    s3_trajectories: int | None = None  # None: max(1, trajectories // 4)
    tail_commits: int = 20
    durable: bool = True  # also measure fsync'd writes and cold (page cache evicted) reads, local
    seed: int = 0


# ---------------------------------------------------------------------------------------------- helpers
def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def _p95(xs: list[float]) -> float:
    s = sorted(xs)
    return float(s[min(len(s) - 1, int(round(0.95 * (len(s) - 1))))])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoServer:
    """A moto S3 server in a subprocess on 127.0.0.1 (a subprocess so that it does not share the benchmark's
    GIL). Context manager; ``endpoint`` is its URL."""

    def __init__(self, port: int | None = None, start_timeout_s: float = 30.0):
        self.port = port or _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._timeout = start_timeout_s
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> MotoServer:
        self._proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + self._timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"moto server exited with code {self._proc.returncode} (is moto[server] installed?)")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.1)
        self.__exit__()
        raise RuntimeError(f"moto server did not listen on port {self.port} within {self._timeout} s")

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None


def _versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for dist in ("tracestore", "numpy", "pyarrow", "zarr", "crc32c", "fsspec", "s3fs", "aiobotocore", "moto"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def machine_info() -> dict:
    return {"cpu_count": os.cpu_count(), "platform": platform.platform(), "machine": platform.machine(),
            "processor": platform.processor() or None, "hostname": socket.gethostname()}


def machine_name() -> str:
    """A short name for result files: ``<arch>-<n>cpu``."""
    return f"{platform.machine() or 'unknown'}-{os.cpu_count()}cpu"


class _Data:
    """One trajectory's worth of random rows, and the ``write`` calls for it (views, built once)."""

    def __init__(self, store, cfg: BenchConfig):
        rng = np.random.default_rng(cfg.seed)
        T = cfg.tokens
        self.hints = {n: rng.integers(0, 256, (T, s.hint_bytes), dtype=np.uint8) for n, s in store.sites.items()}
        self.scales = {n: rng.integers(0, 256, (T, s.scale_bytes), dtype=np.uint8) for n, s in store.sites.items()}
        self.token_ids = rng.integers(0, 150_000, T, dtype=np.int32)
        self.logprobs = -rng.random(T, dtype=np.float32) * 5
        self.experts = {n: rng.integers(0, store.num_experts, (T, store.top_k), dtype=np.uint8)
                        for n in store.moe_layers}
        self.calls = []
        for a in range(0, T, cfg.write_tokens):
            b = min(T, a + cfg.write_tokens)
            self.calls.append((a, {"hints": {n: v[a:b] for n, v in self.hints.items()},
                                   "scales": {n: v[a:b] for n, v in self.scales.items()},
                                   "token_ids": self.token_ids[a:b], "logprobs": self.logprobs[a:b],
                                   "experts": {n: v[a:b] for n, v in self.experts.items()} or None}))


def _sites(cfg: BenchConfig) -> list[Site]:
    return [Site(f"layers.{i}.moe_in", cfg.width, fp4_format=cfg.fp4_format) for i in range(cfg.sites)]


def _make_store(url: str, cfg: BenchConfig, storage_options: dict | None):
    kw = {}
    if cfg.chunk_rows is not None:
        kw["chunk_rows"] = cfg.chunk_rows
    if cfg.shard_bytes is not None:
        kw["shard_bytes"] = cfg.shard_bytes
    layers = [f"layers.{i}.mlp" for i in range(cfg.moe_layers)]
    return create_store(url, _sites(cfg), model={"name": "tracestore-bench"}, moe_layers=layers,
                        top_k=cfg.top_k if layers else 0, num_experts=cfg.num_experts if layers else 0,
                        storage_options=storage_options, **kw)


def _traj(t: int) -> str:
    return f"traj-{t:06d}"


def _store_write(store, data: _Data, n_traj: int, cfg: BenchConfig) -> float:
    t0 = time.perf_counter()
    with store.writer("bench", commit_bytes=cfg.commit_bytes, commit_interval_s=0) as w:
        for t in range(n_traj):
            traj = _traj(t)
            for a, kw in data.calls:
                w.write(traj, a, **kw)
    return time.perf_counter() - t0


def _store_read(store, n_traj: int, tokens: int) -> float:
    t0 = time.perf_counter()
    reader = store.reader()
    for t in range(n_traj):
        reader.read(_traj(t), 0, tokens)
    return time.perf_counter() - t0


def _groups(objects) -> list[list]:
    """Objects grouped as the store wrote them: one group per segment, then one per other object."""
    groups: dict[str, list] = {}
    for o in objects:
        parts = o.key.split("/")
        g = "/".join(parts[:3]) if parts[0] == "data" and len(parts) >= 4 else o.key
        groups.setdefault(g, []).append(o)
    return list(groups.values())


def _read_amplification(store, n_traj: int, tokens: int) -> int:
    """Bytes the store's reads fetch (one untimed pass through a counting wrapper)."""
    backend = store.backend
    original = backend.readinto_ranges
    fetched = [0]

    def counting(requests, *args, **kwargs):
        fetched[0] += sum(r.stop - r.start for r, _ in requests)
        return original(requests, *args, **kwargs)

    backend.readinto_ranges = counting
    try:
        reader = store.reader()
        for t in range(n_traj):
            reader.read(_traj(t), 0, tokens)
    finally:
        del backend.readinto_ranges
    return fetched[0]


# ---------------------------------------------------------------------------------------------- local
def _plain_write_local(root: str, objects, buf: memoryview, fsync: bool = False) -> float:
    t0 = time.perf_counter()
    made: set[str] = set()
    for o in objects:
        path = os.path.join(root, o.key)
        d = os.path.dirname(path)
        if d not in made:
            os.makedirs(d, exist_ok=True)
            made.add(d)
        with open(path, "wb") as f:
            f.write(buf[: o.size])
            if fsync:
                f.flush()
                os.fsync(f.fileno())
    return time.perf_counter() - t0


def _evict(root: str) -> bool:
    """Drop ``root``'s files from the page cache (fsync, then ``POSIX_FADV_DONTNEED``), so that the next read
    comes from the disk. Only this benchmark's files are touched. False where the platform cannot."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return True


def _plain_read_local(root: str, objects) -> float:
    t0 = time.perf_counter()
    for o in objects:
        np.fromfile(os.path.join(root, o.key), dtype=np.uint8)
    return time.perf_counter() - t0


def _plain_read_local_threads(root: str, objects, threads: int) -> float:
    """The plain read on ``threads`` threads, each reading a contiguous run of about equal bytes (as the store's
    local reads share a large read): the baseline for the store's own overhead when both use the cores."""
    runs = [[objects[k] for k in ks] for ks in even_runs([o.size for o in objects], threads)]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(runs)) as ex:
        t0 = time.perf_counter()
        list(ex.map(lambda run: [np.fromfile(os.path.join(root, o.key), dtype=np.uint8) for o in run], runs))
        return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------- s3
def _plain_write_s3(fs, root: str, groups, buf: bytes) -> float:
    t0 = time.perf_counter()
    for g in groups:
        if len(g) == 1:
            fs.pipe_file(f"{root}/{g[0].key}", buf[: g[0].size])
        else:
            fs.pipe({f"{root}/{o.key}": buf[: o.size] for o in g})
    return time.perf_counter() - t0


def _plain_read_s3(fs, root: str, groups) -> float:
    t0 = time.perf_counter()
    for g in groups:
        fs.cat([f"{root}/{o.key}" for o in g])
    return time.perf_counter() - t0


def _tail_latency(url: str, cfg: BenchConfig, storage_options: dict | None, commits: int) -> dict:
    """Commit ``commits`` small records (16 tokens) at random 50-150 ms intervals while a Stream tails."""
    small_cfg = BenchConfig(**{**asdict(cfg), "tokens": 16, "write_tokens": 16})
    store = _make_store(url, small_cfg, storage_options)
    small = _Data(store, small_cfg)
    stream = store.stream(None, timeout_s=10.0)
    seen: list[float] = []

    def consume() -> None:
        for rec in stream:
            seen.append(time.time() - rec.created_unix)
            if len(seen) >= commits:
                return

    th = threading.Thread(target=consume, name="tracestore-bench-tail", daemon=True)
    th.start()
    rng = np.random.default_rng(cfg.seed + 1)
    with store.writer("tail", commit_interval_s=0) as w:
        for k in range(commits):
            w.write(f"tail-{k:05d}", 0, **small.calls[0][1])
            w.flush()
            time.sleep(float(rng.uniform(0.05, 0.15)))
    th.join(15)
    store.close()
    if len(seen) < commits:
        log.warning("tail: saw %d of %d commits", len(seen), commits)
    return {"median": _median(seen) if seen else None, "p95": _p95(seen) if seen else None,
            "max": max(seen) if seen else None, "commits": commits, "seen": len(seen),
            "poll_interval_s": stream.poll_interval_s}


# ---------------------------------------------------------------------------------------------- phases
def _rates(logical: int, tw_store: list[float], tw_plain: list[float], tr_store: list[float],
           tr_plain: list[float]) -> dict:
    """The timings of one phase, its throughputs (MB/s of ``logical`` bytes) and plain/store ratios (medians)."""
    mb = logical / 1e6
    return {
        "write_s_store": tw_store, "write_s_plain": tw_plain, "read_s_store": tr_store, "read_s_plain": tr_plain,
        "write_MBps_store": mb / _median(tw_store), "write_MBps_plain": mb / _median(tw_plain),
        "read_MBps_store": mb / _median(tr_store), "read_MBps_plain": mb / _median(tr_plain),
        "write_ratio": _median(tw_plain) / _median(tw_store), "read_ratio": _median(tr_plain) / _median(tr_store),
    }


def _phase(store_url_of: Callable[[int], str], plain_root_of: Callable[[int], str], cfg: BenchConfig,
           n_traj: int, storage_options: dict | None, plain_write, plain_read, cleanup, progress: Progress | None,
           label: str, plain_read_threaded: tuple[int, Callable] | None = None) -> tuple[dict, object]:
    """Write and read ``n_traj`` trajectories ``repeats`` times through the store and the plain baseline."""
    tw_store, tw_plain, tr_store, tr_plain = [], [], [], []
    data = None
    last_store = None
    objects = None
    logical = 0
    plain_objects = buf = None
    for r in range(cfg.repeats):
        if progress:
            progress(f"{label} write", r, cfg.repeats)
        store = _make_store(store_url_of(r), cfg, storage_options)
        if data is None:
            data = _Data(store, cfg)
        logical = n_traj * cfg.tokens * (store.payload_bytes_per_token + store.trace_bytes_per_token)
        # alternate which side writes first (as the reads do): the page cache's dirty-page writeback and the
        # S3 server's memory would otherwise always hit the same side. The plain side writes the objects
        # (names and sizes) of the store's latest write.
        plain_first = r % 2 == 1 and plain_objects is not None
        if plain_first:
            tw_plain.append(plain_write(plain_root_of(r), plain_objects, buf))
        tw_store.append(_store_write(store, data, n_traj, cfg))
        objects = store.backend.list("")
        if not plain_first:
            plain_objects = objects
            buf = np.random.default_rng(cfg.seed + 2).integers(0, 256, max(o.size for o in objects), dtype=np.uint8)
            tw_plain.append(plain_write(plain_root_of(r), plain_objects, buf))
        if r > 0:
            cleanup(r - 1)  # keep the store in memory only once (moto holds objects in RAM)
        last_store = store
    assert last_store is not None and objects is not None and plain_objects is not None
    for r in range(cfg.repeats):
        if progress:
            progress(f"{label} read", r, cfg.repeats)
        # alternate the order so neither side always reads second
        if r % 2 == 0:
            tr_store.append(_store_read(last_store, n_traj, cfg.tokens))
            tr_plain.append(plain_read(plain_root_of(cfg.repeats - 1), plain_objects))
        else:
            tr_plain.append(plain_read(plain_root_of(cfg.repeats - 1), plain_objects))
            tr_store.append(_store_read(last_store, n_traj, cfg.tokens))
    threaded = {}
    if plain_read_threaded is not None:
        threads, read_threaded = plain_read_threaded
        tr_threaded = [read_threaded(plain_root_of(cfg.repeats - 1), plain_objects) for _ in range(cfg.repeats)]
        threaded = {"read_threads_store": threads, "read_s_plain_threaded": tr_threaded,
                    "read_ratio_vs_threaded_plain": _median(tr_threaded) / _median(tr_store)}
    fetched = _read_amplification(last_store, n_traj, cfg.tokens)
    res = {
        "trajectories": n_traj, "tokens": n_traj * cfg.tokens, "logical_bytes": logical,
        "stored_bytes": sum(o.size for o in objects), "objects": len(objects),
        **_rates(logical, tw_store, tw_plain, tr_store, tr_plain),
        "read_fetched_bytes": fetched, "read_amplification": fetched / logical, **threaded,
    }
    if progress:
        progress(f"{label} read", cfg.repeats, cfg.repeats)
    return res, last_store


def _durable_phase(run_dir: str, cfg: BenchConfig, progress: Progress | None) -> dict:
    """Local, durable and cold: the store with ``fsync=True`` vs plain files fsync'd one by one; reads after
    evicting both from the page cache (``POSIX_FADV_DONTNEED``), alternating which side reads first."""
    tw_store, tw_plain, tr_store, tr_plain = [], [], [], []
    data = objects = store = None
    logical = 0
    evicted = True
    for r in range(cfg.repeats):
        if progress:
            progress("local fsync write", r, cfg.repeats)
        s_url, p_root = os.path.join(run_dir, f"dstore-{r}"), os.path.join(run_dir, f"dplain-{r}")
        store = _make_store(s_url, cfg, {"fsync": True})
        if data is None:
            data = _Data(store, cfg)
        logical = cfg.trajectories * cfg.tokens * (store.payload_bytes_per_token + store.trace_bytes_per_token)
        tw_store.append(_store_write(store, data, cfg.trajectories, cfg))
        objects = store.backend.list("")
        buf = np.random.default_rng(cfg.seed + 2).integers(0, 256, max(o.size for o in objects), dtype=np.uint8)
        tw_plain.append(_plain_write_local(p_root, objects, memoryview(buf), fsync=True))
        if r > 0:
            shutil.rmtree(os.path.join(run_dir, f"dstore-{r - 1}"), ignore_errors=True)
            shutil.rmtree(os.path.join(run_dir, f"dplain-{r - 1}"), ignore_errors=True)
    assert store is not None and objects is not None
    s_url, p_root = store.url, os.path.join(run_dir, f"dplain-{cfg.repeats - 1}")
    for r in range(cfg.repeats):
        if progress:
            progress("local cold read", r, cfg.repeats)
        for side in ((0, 1) if r % 2 == 0 else (1, 0)):
            evicted = _evict(s_url) and _evict(p_root) and evicted
            if side == 0:
                tr_store.append(_store_read(store, cfg.trajectories, cfg.tokens))
            else:
                tr_plain.append(_plain_read_local(p_root, objects))
    store.close()
    return {
        **_rates(logical, tw_store, tw_plain, tr_store, tr_plain),
        "page_cache_evicted": evicted,
    }


def _bytes_section(store) -> dict:
    d = info(store)
    b = d["bytes"]
    tokens = d["tokens"]
    # everything that is neither data nor garbage: zarr metadata, log entries, log checkpoints, manifest
    index_log = sum(v for k, v in b.items() if k not in ("payload", "trace", "orphan", "partial", "other", "total"))
    payload_logical = tokens * store.payload_bytes_per_token
    trace_logical = tokens * store.trace_bytes_per_token
    stored = b["payload"] + b["trace"] + index_log
    return {
        "tokens": tokens,
        "payload_bytes_per_token": store.payload_bytes_per_token,
        "trace_bytes_per_token": store.trace_bytes_per_token,
        "stored_payload_bytes_per_token": b["payload"] / tokens,
        "stored_trace_bytes_per_token": b["trace"] / tokens,
        "index_log_bytes_per_token": index_log / tokens,
        "bytes_per_token": stored / tokens,
        "bytes_per_token_without_trace": (b["payload"] + index_log) / tokens,
        "overhead_payload": (b["payload"] + index_log) / payload_logical - 1.0,
        "overhead_total": stored / (payload_logical + trace_logical) - 1.0,
        "trace_share": b["trace"] / stored,
        "bytes": {k: v for k, v in b.items()},
        "segments": d["segments"], "log_entries": d["log_entries"], "objects": d["objects"],
    }


def run_bench(cfg: BenchConfig | None = None, progress: Progress | None = None) -> dict:
    """Run the benchmark; returns one JSON-able dict (see the module docstring). Never deletes ``cfg.url``
    itself, only what it created below it."""
    cfg = cfg or BenchConfig()
    if cfg.trajectories <= 0 or cfg.tokens <= 0 or cfg.repeats <= 0 or cfg.write_tokens <= 0:
        raise ValueError(f"trajectories, tokens, repeats and write_tokens must be > 0, got {cfg}")
    tmp = None
    base = cfg.url
    if base is None:
        tmp = base = tempfile.mkdtemp(prefix="tracestore-bench-")
    run_dir = os.path.join(os.path.abspath(base), f"run-{uuid.uuid4().hex[:8]}")
    os.makedirs(run_dir)
    t_start = time.perf_counter()
    result: dict = {"config": {k: v for k, v in asdict(cfg).items() if k != "s3_storage_options"}}
    result["method"] = {
        "read": "the store reads each trajectory with Reader.read (numpy, trace included, every chunk's crc32c "
                "checked) and drops the batch before the next read, as a trainer consuming micro-batches does: the "
                "reader recycles the previous batch's output memory (a batch still referenced is never "
                "overwritten); the plain side reads each file into a fresh numpy array (np.fromfile / s3fs cat)",
        "order": "reads alternate which side goes first; so do writes (the plain side writes the objects, names "
                 "and sizes, of the store's latest write)",
    }
    try:
        # ---------------- local
        def store_url(r: int) -> str:
            return os.path.join(run_dir, f"store-{r}")

        def plain_root(r: int) -> str:
            return os.path.join(run_dir, f"plain-{r}")

        def cleanup_local(r: int) -> None:
            shutil.rmtree(store_url(r), ignore_errors=True)
            shutil.rmtree(plain_root(r), ignore_errors=True)

        local, store = _phase(store_url, plain_root, cfg, cfg.trajectories, None,
                              lambda root, objs, buf: _plain_write_local(root, objs, memoryview(buf)),
                              _plain_read_local, cleanup_local, progress, "local",
                              plain_read_threaded=(threads, lambda root, objs: _plain_read_local_threads(root, objs, threads))
                              if (threads := LocalBackend.read_threads) > 1 else None)
        sizes = _bytes_section(store)
        store.close()
        result.update({
            "payload_bytes_per_token": sizes["payload_bytes_per_token"],
            "trace_bytes_per_token": sizes["trace_bytes_per_token"],
            "bytes_per_token": sizes["bytes_per_token"],
            "bytes_per_token_without_trace": sizes["bytes_per_token_without_trace"],
            "overhead_payload": sizes["overhead_payload"],
            "overhead_total": sizes["overhead_total"],
            "write_ratio_local": local["write_ratio"], "read_ratio_local": local["read_ratio"],
            "read_ratio_local_vs_threaded_plain": local.get("read_ratio_vs_threaded_plain"),
        })
        durable = None
        if cfg.durable:
            durable = _durable_phase(run_dir, cfg, progress)
            result["write_ratio_local_fsync"] = durable["write_ratio"]
            result["read_ratio_local_cold"] = durable["read_ratio"]
        if progress:
            progress("tail latency", 0, 1)
        tail = _tail_latency(os.path.join(run_dir, "tail"), cfg, None, cfg.tail_commits)
        result["tail_latency_s"] = tail["median"]
        result["tail_latency_p95_s"] = tail["p95"]
        cleanup_local(cfg.repeats - 1)
        # ---------------- s3
        s3 = None
        if cfg.s3:
            s3 = _run_s3(cfg, progress)
            result["write_ratio_s3"] = s3["write_ratio"]
            result["read_ratio_s3"] = s3["read_ratio"]
        result["sizes"] = sizes
        result["local"] = local
        result["local_durable"] = durable
        result["tail"] = tail
        result["s3"] = s3
        result["goals"] = {
            "overhead_payload <= 0.01": sizes["overhead_payload"] <= 0.01,
            "write_ratio_local >= 0.8": local["write_ratio"] >= 0.8,
            "read_ratio_local >= 0.8": local["read_ratio"] >= 0.8,
            "write_ratio_s3 >= 0.8": None if s3 is None else s3["write_ratio"] >= 0.8,
            "read_ratio_s3 >= 0.8": None if s3 is None else s3["read_ratio"] >= 0.8,
            "write_ratio_local_fsync >= 0.8": None if durable is None else durable["write_ratio"] >= 0.8,
            "read_ratio_local_cold >= 0.8": None if durable is None else durable["read_ratio"] >= 0.8,
            "tail_latency_s < 1": tail["median"] is not None and tail["median"] < 1.0,
        }
        result["machine"] = machine_info()
        result["versions"] = _versions()
        result["wall_s"] = time.perf_counter() - t_start
        result["unix_time"] = time.time()
        return result
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _run_s3(cfg: BenchConfig, progress: Progress | None) -> dict:
    import s3fs

    n_traj = cfg.s3_trajectories or max(1, cfg.trajectories // 4)
    server = None
    if cfg.s3_endpoint is None:
        server = MotoServer().__enter__()
        endpoint = server.endpoint
        options = {"key": "testing", "secret": "testing",
                   "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
    else:
        endpoint = cfg.s3_endpoint
        options = dict(cfg.s3_storage_options or {})
        options.setdefault("client_kwargs", {}).setdefault("endpoint_url", endpoint)
    try:
        fs = s3fs.S3FileSystem(**options)
        bucket = cfg.s3_bucket
        if not fs.exists(bucket):
            fs.call_s3("create_bucket", Bucket=bucket)  # no LocationConstraint: us-east-1 / the server default
        prefix = f"{bucket}/bench-{uuid.uuid4().hex[:8]}"

        def store_url(r: int) -> str:
            return f"s3://{prefix}/store-{r}"

        def plain_root(r: int) -> str:
            return f"{prefix}/plain-{r}"

        def cleanup(r: int) -> None:
            for p in (store_url(r)[len("s3://"):], plain_root(r)):
                try:
                    fs.rm(p, recursive=True)
                except FileNotFoundError:
                    pass

        def plain_write(root, objects, buf):
            return _plain_write_s3(fs, root, _groups(objects), buf.tobytes())

        def plain_read(root, objects):
            return _plain_read_s3(fs, root, _groups(objects))

        res, store = _phase(store_url, plain_root, cfg, n_traj, options, plain_write, plain_read, cleanup,
                            progress, "s3")
        store.close()
        if progress:
            progress("s3 tail latency", 0, 1)
        tail = _tail_latency(f"s3://{prefix}/tail", cfg, options, max(5, cfg.tail_commits // 2))
        res["tail_latency_s"] = tail["median"]
        res["tail_latency_p95_s"] = tail["p95"]
        res["endpoint"] = "moto (subprocess, 127.0.0.1)" if server is not None else endpoint
        cleanup(cfg.repeats - 1)
        try:
            fs.rm(f"{prefix}/tail", recursive=True)
        except FileNotFoundError:
            pass
        return res
    finally:
        if server is not None:
            server.__exit__()


def summary_rows(result: dict) -> list[tuple[str, str, str]]:
    """(metric, value, goal) rows for a human table."""
    def f(v, fmt="{:.3f}"):
        return "-" if v is None else fmt.format(v)

    s3 = result.get("s3") or {}
    loc = result["local"]
    rows = [
        ("payload bytes/token (logical)", f(result["payload_bytes_per_token"], "{:,}"), ""),
        ("trace bytes/token (logical)", f(result["trace_bytes_per_token"], "{:,}"), ""),
        ("stored bytes/token (all)", f(result["bytes_per_token"], "{:,.1f}"), ""),
        ("stored bytes/token (no trace)", f(result["bytes_per_token_without_trace"], "{:,.1f}"), ""),
        ("overhead on payload", f(100 * result["overhead_payload"], "{:.3f}%"), "<= 1%"),
        ("overhead on payload+trace", f(100 * result["overhead_total"], "{:.3f}%"), ""),
        ("local write MB/s store / plain", f"{loc['write_MBps_store']:.0f} / {loc['write_MBps_plain']:.0f}", ""),
        ("write_ratio_local", f(result["write_ratio_local"]), ">= 0.8"),
        ("local read MB/s store / plain", f"{loc['read_MBps_store']:.0f} / {loc['read_MBps_plain']:.0f}", ""),
        ("read_ratio_local", f(result["read_ratio_local"]), ">= 0.8"),
    ]
    if "read_ratio_vs_threaded_plain" in loc:
        rows.append((f"  vs plain reads on {loc['read_threads_store']} threads (as the store reads)",
                     f(loc["read_ratio_vs_threaded_plain"]), ""))
    rows += [
        ("read amplification (local)", f(loc["read_amplification"]), ""),
    ]
    dur = result.get("local_durable")
    if dur:
        rows += [
            ("local fsync write MB/s store / plain", f"{dur['write_MBps_store']:.0f} / {dur['write_MBps_plain']:.0f}",
             ""),
            ("write_ratio_local_fsync", f(dur["write_ratio"]), ">= 0.8"),
            ("local cold read MB/s store / plain", f"{dur['read_MBps_store']:.0f} / {dur['read_MBps_plain']:.0f}", ""),
            ("read_ratio_local_cold", f(dur["read_ratio"]), ">= 0.8"),
        ]
    if s3:
        rows += [
            ("s3 write MB/s store / plain", f"{s3['write_MBps_store']:.0f} / {s3['write_MBps_plain']:.0f}", ""),
            ("write_ratio_s3", f(result.get("write_ratio_s3")), ">= 0.8"),
            ("s3 read MB/s store / plain", f"{s3['read_MBps_store']:.0f} / {s3['read_MBps_plain']:.0f}", ""),
            ("read_ratio_s3", f(result.get("read_ratio_s3")), ">= 0.8"),
            ("s3 tail latency median / p95 s", f"{f(s3.get('tail_latency_s'))} / {f(s3.get('tail_latency_p95_s'))}", ""),
        ]
    rows.append(("tail latency median / p95 s (local)",
                 f"{f(result['tail_latency_s'])} / {f(result['tail_latency_p95_s'])}", "< 1 s"))
    return rows


def to_json(result: dict) -> str:
    return json.dumps(result, indent=1, sort_keys=False)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's command-line flags (shared by ``tracestore bench`` and ``benchmarks/benchmark_store.py``)."""
    d = BenchConfig()
    p.add_argument("--trajectories", type=positive_int, default=d.trajectories, help=f"trajectories (default {d.trajectories})")
    p.add_argument("--tokens", type=positive_int, default=d.tokens, help=f"tokens per trajectory (default {d.tokens})")
    p.add_argument("--sites", type=positive_int, default=d.sites, help=f"hinted sites (default {d.sites})")
    p.add_argument("--width", type=positive_int, default=d.width, help=f"values per site (default {d.width})")
    p.add_argument("--fp4-format", choices=("nvfp4", "mxfp4"), default=d.fp4_format,
                   help=f"FP4 format of the sites (default {d.fp4_format})")
    p.add_argument("--moe-layers", type=nonneg_int, default=d.moe_layers,
                   help=f"MoE layers in the trace (default {d.moe_layers}; 0 = no routed experts)")
    p.add_argument("--top-k", type=positive_int, default=d.top_k,
                   help=f"routed experts per token and MoE layer (default {d.top_k})")
    p.add_argument("--num-experts", type=positive_int, default=d.num_experts,
                   help=f"experts per MoE layer (default {d.num_experts})")
    p.add_argument("--write-tokens", type=positive_int, default=d.write_tokens,
                   help=f"tokens per Writer.write call (default {d.write_tokens})")
    p.add_argument("--commit-bytes", type=positive_int, default=d.commit_bytes, help="writer commit size (default 64 MiB)")
    p.add_argument("--chunk-rows", type=positive_int, default=None, help="store layout (default: the store default)")
    p.add_argument("--shard-bytes", type=positive_int, default=None, help="store layout (default: the store default)")
    p.add_argument("--repeats", type=positive_int, default=d.repeats, help=f"repeats, median reported (default {d.repeats})")
    p.add_argument("--url", help="local benchmark directory (default: a temporary directory)")
    p.add_argument("--s3", action=argparse.BooleanOptionalAction, default=True,
                   help="also benchmark S3 (default: yes, against a moto server on 127.0.0.1)")
    p.add_argument("--s3-endpoint", help="S3 endpoint URL (default: start a moto server)")
    p.add_argument("--s3-bucket", default=d.s3_bucket, help=f"bucket for --s3-endpoint (default {d.s3_bucket})")
    p.add_argument("--s3-trajectories", type=positive_int, help="trajectories on S3 (default trajectories // 4)")
    p.add_argument("--durable", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure fsync'd writes and cold reads locally (default: yes)")
    p.add_argument("--tail-commits", type=positive_int, default=d.tail_commits,
                   help=f"commits timed for the tail latency (default {d.tail_commits})")
    p.add_argument("--out", metavar="FILE", help="save the JSON result here")


def config_from_args(args: argparse.Namespace, s3_storage_options: dict | None = None) -> BenchConfig:
    return BenchConfig(
        trajectories=args.trajectories, tokens=args.tokens, sites=args.sites, width=args.width,
        fp4_format=args.fp4_format, moe_layers=args.moe_layers, top_k=args.top_k, num_experts=args.num_experts,
        write_tokens=args.write_tokens, commit_bytes=args.commit_bytes, chunk_rows=args.chunk_rows,
        shard_bytes=args.shard_bytes, repeats=args.repeats, url=args.url, s3=args.s3,
        s3_endpoint=args.s3_endpoint or getattr(args, "endpoint_url", None), s3_bucket=args.s3_bucket,
        s3_storage_options=s3_storage_options, s3_trajectories=args.s3_trajectories, durable=args.durable,
        tail_commits=args.tail_commits)
