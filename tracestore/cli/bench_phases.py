"""The measurements of the store benchmark (:mod:`tracestore.cli.bench` says what each one measures): the store and
the plain baseline side by side, local (page cache; fsync'd and cold) and on S3, and the tail latency."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import statistics
import threading
import time
import uuid
from collections.abc import Callable

import numpy as np

from ..maintenance import info
from ..storage._local import LocalBackend, even_runs
from ..store import Site, create_store
from .bench_config import BenchConfig, Progress
from .moto import MotoServer

__all__ = ["run_local", "run_s3"]

log = logging.getLogger(__name__)


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def _p95(xs: list[float]) -> float:
    s = sorted(xs)
    return float(s[min(len(s) - 1, int(round(0.95 * (len(s) - 1))))])


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
    small_cfg = dataclasses.replace(cfg, tokens=16, write_tokens=16)
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


def run_local(run_dir: str, cfg: BenchConfig, progress: Progress | None) -> dict:
    """The local phases below ``run_dir``: page-cache write/read ratios (``local``) and the store's bytes
    (``sizes``), fsync'd writes and cold reads (``durable``, None unless ``cfg.durable``), tail latency (``tail``)."""
    def store_url(r: int) -> str:
        return os.path.join(run_dir, f"store-{r}")

    def plain_root(r: int) -> str:
        return os.path.join(run_dir, f"plain-{r}")

    def cleanup_local(r: int) -> None:
        shutil.rmtree(store_url(r), ignore_errors=True)
        shutil.rmtree(plain_root(r), ignore_errors=True)

    threads = LocalBackend.read_threads
    local, store = _phase(store_url, plain_root, cfg, cfg.trajectories, None,
                          lambda root, objs, buf: _plain_write_local(root, objs, memoryview(buf)),
                          _plain_read_local, cleanup_local, progress, "local",
                          plain_read_threaded=(threads, lambda root, objs: _plain_read_local_threads(root, objs, threads))
                          if threads > 1 else None)
    sizes = _bytes_section(store)
    store.close()
    durable = _durable_phase(run_dir, cfg, progress) if cfg.durable else None
    if progress:
        progress("tail latency", 0, 1)
    tail = _tail_latency(os.path.join(run_dir, "tail"), cfg, None, cfg.tail_commits)
    cleanup_local(cfg.repeats - 1)
    return {"local": local, "sizes": sizes, "durable": durable, "tail": tail}


def run_s3(cfg: BenchConfig, progress: Progress | None) -> dict:
    """The S3 phase (against ``cfg.s3_endpoint``, or a moto server started here): write/read ratios, tail latency."""
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
