"""Pause one actor's storage requests at a chosen step, for tests of interleavings (gc against writers).

Each actor (a writer, a gc run) works on its own :class:`~tracestore.store.Store`, so its own backend object: a
:class:`Gate` replaces one method of that object (an instance attribute shadows the class's method; the store's
commit log shares the object), so only that actor's requests stop. ``before``: the request waits before it is sent
(a PUT delayed on the way); ``after``: it is sent and applied, and the answer waits (a listing taken, then a slow
caller). ``split`` (``put_many`` only): the first half of the objects is written, then the wait, then the rest (a
segment half written when someone looks). The same gates work on every backend (local directory, S3 via s3fs).

    gate = Gate(writer_store, "put_if_absent", r"^log/")
    thread = start(writer.flush)
    gate.reached.wait(10)        # the writer's conditional PUT of its log entry is on its way ...
    ts.collect_garbage(gc_store)  # ... and gc runs meanwhile
    gate.open()
"""

from __future__ import annotations

import random
import re
import threading
import time

WAIT_S = 60.0  # a gate nobody opens lets the request go after this long (a test failing, not hanging)


def _keys(method: str, args: tuple, kwargs: dict) -> list[str]:
    """The object keys (or the listing prefix) a backend call touches."""
    if method in ("put_many",):
        return list(args[0])
    if method in ("get_many", "delete_many"):
        return list(args[0])
    if method in ("list", "list_after"):
        return [args[0] if args else kwargs.get("prefix", "")]
    return [args[0]] if args else []


class Gate:
    """Stop the ``times`` first calls of ``method`` on ``store``'s backend that touch a key matching ``pattern``.

    ``reached`` is set when a call arrives at the gate; the call goes on when :meth:`open` is called (or after
    ``delay_s`` seconds if given, without waiting for :meth:`open`)."""

    def __init__(self, store, method: str, pattern: str = "", *, where: str = "before", times: int | None = 1,
                 delay_s: float | None = None):
        assert where in ("before", "after", "split"), where
        assert where != "split" or method == "put_many"
        self.backend = store.backend
        self.method = method
        self.where = where
        self.times = times
        self.delay_s = delay_s
        self.reached = threading.Event()
        self._open = threading.Event()
        self._re = re.compile(pattern)
        self._lock = threading.Lock()
        self.hits = 0
        self.original = getattr(self.backend, method)
        setattr(self.backend, method, self._call)

    def open(self) -> None:
        self._open.set()

    def remove(self) -> None:
        """Put the backend's method back (calls at the gate go on)."""
        self.open()
        if self.backend.__dict__.get(self.method) == self._call:
            delattr(self.backend, self.method)

    def _hit(self, args: tuple, kwargs: dict) -> bool:
        with self._lock:
            if self.times is not None and self.hits >= self.times:
                return False
            if not any(self._re.search(k) for k in _keys(self.method, args, kwargs)):
                return False
            self.hits += 1
            return True

    def _wait(self) -> None:
        self.reached.set()
        if self.delay_s is not None:
            time.sleep(self.delay_s)
        else:
            self._open.wait(WAIT_S)

    def _call(self, *args, **kwargs):
        if not self._hit(args, kwargs):
            return self.original(*args, **kwargs)
        if self.where == "before":
            self._wait()
            return self.original(*args, **kwargs)
        if self.where == "after":
            out = self.original(*args, **kwargs)
            self._wait()
            return out
        items = list(args[0].items())
        half = max(1, len(items) // 2)
        self.original(dict(items[:half]), *args[1:], **kwargs)
        self._wait()
        return self.original(dict(items[half:]), *args[1:], **kwargs)


class Jitter:
    """Random pauses in every call of ``methods`` on ``store``'s backend: with probability ``p`` a call sleeps a
    uniform time in ``[0, max_s]`` before it is sent (``before``) or before its answer returns (``after``), the
    choice random too. Seeded; counts what it did in :attr:`stats`."""

    def __init__(self, store, methods, *, p: float, max_s: float, seed: int):
        self.backend = store.backend
        self.rng = random.Random(seed)
        self.p, self.max_s = p, max_s
        self.stats = {"calls": 0, "paused": 0, "paused_s": 0.0}
        self._lock = threading.Lock()
        self.methods = list(methods)
        for m in self.methods:
            setattr(self.backend, m, self._wrap(getattr(self.backend, m)))

    def _draw(self) -> tuple[float, bool]:
        with self._lock:
            self.stats["calls"] += 1
            if self.rng.random() >= self.p:
                return 0.0, False
            pause = self.rng.uniform(0, self.max_s)
            self.stats["paused"] += 1
            self.stats["paused_s"] += pause
            return pause, self.rng.random() < 0.5

    def _wrap(self, original):
        def call(*args, **kwargs):
            pause, after = self._draw()
            if pause and not after:
                time.sleep(pause)
            out = original(*args, **kwargs)
            if pause and after:
                time.sleep(pause)
            return out
        return call

    def remove(self) -> None:
        for m in self.methods:
            self.backend.__dict__.pop(m, None)


class Actor(threading.Thread):
    """``fn(*args, **kwargs)`` in a daemon thread; after :meth:`join`, ``value`` is what it returned and ``error``
    what it raised (None if nothing)."""

    def __init__(self, fn, *args, **kwargs):
        super().__init__(daemon=True, name=getattr(fn, "__name__", "actor"))
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.value = self.error = None

    def run(self) -> None:
        try:
            self.value = self.fn(*self.args, **self.kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            self.error = e

    def result(self, timeout: float = WAIT_S):
        """Join, re-raise what ``fn`` raised, return its value."""
        self.join(timeout)
        assert not self.is_alive(), f"{self.name} did not finish within {timeout} s"
        if self.error is not None:
            raise self.error
        return self.value


def start(fn, *args, **kwargs) -> Actor:
    """Run ``fn(*args, **kwargs)`` in an :class:`Actor` thread."""
    actor = Actor(fn, *args, **kwargs)
    actor.start()
    return actor


def gc_campaign(url: str, options: dict | None, *, writers: int, trajectories: int, tokens: int, seed: int,
                grace_s: float = 0.5, writer_pause: tuple[float, float] = (0.3, 1.0),
                gc_pause: tuple[float, float] = (0.4, 1.0), gc_runs: int = 1, step: int = 16,
                commit_bytes: int = 1000) -> dict:
    """Writers with slow commits against gc runs with slow steps, on one store, in real time; then every check.

    ``writers`` writers (own store objects) write ``trajectories`` trajectories each (``tokens`` tokens in writes of
    ``step``, then a result), their storage calls paused at random (``writer_pause`` = (probability, longest pause
    in seconds), before the request is sent or before its answer returns: slow data writes, slow conditional PUTs,
    slow log reads); ``gc_runs`` gc loops (own store objects) run ``collect_garbage`` at the store's grace
    (``grace_s``, shorter than many of those pauses) with their listing, log reads, gc-entry PUTs and deletions paused
    alike (``gc_pause``); a follower tails the log and reads every record. Afterwards: verify is clean, every token
    and result of every trajectory reads back right, the follower saw every record exactly once in log order and
    never an error, gc deleted segments (writers wrote some again) and never a committed one.

    Returns ``{"counts": {...}, "problems": [...]}`` (no problems when everything held).
    """
    import tracestore as ts
    from helpers.store import check_batch, rows

    ts.create_store(url, [ts.Site("s0", 128), ts.Site("s1", 64)], moe_layers=["m0"], top_k=2, num_experts=8,
                    storage_options=options, chunk_rows=16, shard_bytes=4096, gc_grace_s=grace_s)
    problems: list[str] = []
    counts: dict = {"writers": writers, "trajectories": writers * trajectories, "tokens_each": tokens}
    done = threading.Event()
    lock = threading.Lock()

    def add(key: str, n: float) -> None:
        with lock:
            counts[key] = counts.get(key, 0) + n

    slow_methods = ("put_many", "put_if_absent", "get", "get_many", "exists", "list_after", "list", "delete_many")

    def writer(k: int) -> None:
        ws = ts.open_store(url, storage_options=options)
        jitter = Jitter(ws, slow_methods, p=writer_pause[0], max_s=writer_pause[1], seed=seed * 1000 + k)
        w = ws.writer(f"w{k}", commit_bytes=commit_bytes, commit_interval_s=0, commit_timeout_s=120)
        for t in range(trajectories):
            traj = f"w{k}-t{t}"
            for pos in range(0, tokens, step):
                w.write(traj, pos, **rows(ws, traj, pos, min(tokens, pos + step)))
            w.write_result(traj, reward=float(t), group_id=f"w{k}", prompt_len=step, response_len=tokens - step)
        w.close()
        jitter.remove()
        for key in ("segments", "rewritten", "lost_races", "results"):
            add(f"writer_{key}", w.stats[key])
        add("writer_calls", jitter.stats["calls"])
        add("writer_paused", jitter.stats["paused"])
        add("writer_paused_s", round(jitter.stats["paused_s"], 1))

    def gc_loop(k: int) -> None:
        gs = ts.open_store(url, storage_options=options)
        jitter = Jitter(gs, slow_methods, p=gc_pause[0], max_s=gc_pause[1], seed=seed * 1000 + 500 + k)
        while not done.is_set():
            try:
                rep = ts.collect_garbage(gs)
            except ts.TraceStoreError as e:
                problems.append(f"gc: {type(e).__name__}: {e}")
                return
            add("gc_runs", 1)
            add("gc_entries", len(rep.gc_entries))
            add("gc_deleted_segments", len(rep.deleted_segments))
            add("gc_committed_meanwhile", len(rep.committed_meanwhile))
        add("gc_calls", jitter.stats["calls"])
        add("gc_paused", jitter.stats["paused"])
        add("gc_paused_s", round(jitter.stats["paused_s"], 1))

    seen: list[tuple[int, int, str, int, int]] = []

    def follow() -> None:
        fs = ts.open_store(url, storage_options=options)
        stream = fs.stream(timeout_s=0.3, poll_interval_s=0.02)
        try:
            while True:
                finished = done.is_set()
                for item in stream:
                    if item.kind == "record":
                        check_batch(fs, stream.read(item, fmt="numpy"), item.traj_id, item.token_start,
                                    item.token_stop)
                        seen.append((item.seq, item.index, item.traj_id, item.token_start, item.token_stop))
                if finished:
                    return
        except (ts.TraceStoreError, AssertionError) as e:
            problems.append(f"follower: {type(e).__name__}: {e}")

    t0 = time.monotonic()
    background = [start(gc_loop, k) for k in range(gc_runs)] + [start(follow)]
    actors = [start(writer, k) for k in range(writers)]
    for a in actors:
        a.join(600)
        if a.error is not None:
            problems.append(f"writer: {type(a.error).__name__}: {a.error}")
    done.set()
    for a in background:
        a.join(120)
        if a.is_alive():
            problems.append(f"{a.name} did not finish")
    counts["seconds"] = round(time.monotonic() - t0, 1)

    final = ts.open_store(url, storage_options=options)
    ts.collect_garbage(final)  # what the last runs left (rewritten segments' old versions, named by gc entries)
    report = ts.verify(final)
    if not report.ok:
        problems.append(f"verify: {report.errors[:3]}")
    reader = final.reader()
    for k in range(writers):
        for t in range(trajectories):
            traj = f"w{k}-t{t}"
            try:
                check_batch(final, reader.read(traj, 0, tokens, fmt="numpy"), traj, 0, tokens)
                if reader.result(traj) is None or reader.result(traj).reward != float(t):
                    problems.append(f"{traj}: result {reader.result(traj)}")
            except (ts.TraceStoreError, AssertionError) as e:
                problems.append(f"final read {traj}: {type(e).__name__}: {e}")
    entries = final.read_entries(0, final.head())
    committed = [(e.seq, i, t, a, b) for e in entries for i, (t, a, b, _ro, _pv) in enumerate(e.records())]
    if seen != committed:
        problems.append(f"follower saw {len(seen)} records, the log has {len(committed)} (exactly once, in order)")
    counts["log_entries"] = len(entries)
    counts["gc_entries_in_log"] = sum(e.kind == "gc" for e in entries)
    counts["orphans_left"] = len(report.orphan_segments)
    return {"counts": counts, "problems": problems}
