"""A fault-injecting HTTP proxy between s3fs and the moto S3 server.

moto on loopback never throttles, resets, fails after applying a request or goes down; real S3 does all of
that. :class:`FaultProxy` listens on 127.0.0.1 (a free port), forwards every request to the upstream moto server
unchanged, and, by rule or at random with a seed, instead:

* ``error``        answers an S3 error (default 503 SlowDown) without forwarding,
* ``reset``        resets the connection (TCP RST) without forwarding,
* ``delay``        waits ``delay_s`` seconds, then forwards,
* ``apply_error``  forwards (the request is applied), then answers an error instead of moto's response,
* ``apply_reset``  forwards (applied), then resets the connection,
* ``apply_delay``  forwards (applied), then waits ``delay_s`` before answering;

:meth:`FaultProxy.down` closes the listening socket (connection refused) until :meth:`FaultProxy.up`.
Every request and every injected fault is counted (:attr:`FaultProxy.stats`) and logged (:attr:`FaultProxy.log`).
"""

from __future__ import annotations

import http.client
import http.server
import random
import re
import socket
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

ACTIONS = ("error", "reset", "delay", "apply_error", "apply_reset", "apply_delay")
_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade", "expect"}
_STATUS = {"SlowDown": 503, "ServiceUnavailable": 503, "InternalError": 500, "RequestTimeout": 400,
           "AccessDenied": 403, "InvalidAccessKeyId": 403, "NoSuchBucket": 404}


@dataclass
class Rule:
    """Inject ``action`` into requests whose method is ``method`` (None: any) and whose path (``/bucket/key?query``)
    matches the regex ``path`` (None: any). The first ``skip`` matches pass untouched; then ``times`` matches
    (None: every one) get the fault."""

    action: str
    method: str | None = None
    path: str | None = None
    times: int | None = 1
    skip: int = 0
    code: str = "SlowDown"
    delay_s: float = 0.5
    hits: int = field(default=0, init=False)
    _seen: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"action {self.action!r} not in {ACTIONS}")
        self._re = re.compile(self.path) if self.path is not None else None

    def matches(self, method: str, path: str) -> bool:
        if self.method is not None and method != self.method:
            return False
        if self._re is not None and not self._re.search(path):
            return False
        if self.times is not None and self.hits >= self.times:
            return False
        self._seen += 1
        if self._seen <= self.skip:
            return False
        self.hits += 1
        return True


def _error_body(code: str) -> bytes:
    return (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>injected by the test proxy'
            f'</Message><RequestId>faultproxy</RequestId></Error>').encode()


class FaultProxy:
    """See the module docstring. Use as a context manager or call :meth:`start` / :meth:`stop`."""

    def __init__(self, upstream: str, *, seed: int = 0):
        m = re.fullmatch(r"http://([^:/]+):(\d+)/?", upstream)
        if not m:
            raise ValueError(f"upstream must be http://host:port, got {upstream!r}")
        self.upstream = (m.group(1), int(m.group(2)))
        self.rules: list[Rule] = []
        self.stats: Counter = Counter()
        self.log: list[tuple[str, str, str]] = []
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._chaos: dict[str, float] = {}
        self._chaos_delay_s = 0.1
        self._chaos_methods: set[str] | None = None
        self._server: http.server.ThreadingHTTPServer | None = None
        self._conns: set[socket.socket] = set()
        self._thread: threading.Thread | None = None
        self.port = 0

    # ------------------------------------------------------------------ control
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def storage_options(self, *, client_retries: bool = False) -> dict:
        """s3fs options that go through this proxy. ``client_retries=False`` turns off botocore's own retries (s3fs's
        are a class attribute: see :func:`no_s3fs_retries`), so that injected faults reach tracestore (which must
        retry or raise a typed error)."""
        opts: dict = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": self.url},
                      "skip_instance_cache": True}
        if not client_retries:
            opts["config_kwargs"] = {"retries": {"total_max_attempts": 1, "mode": "standard"},
                                     "connect_timeout": 2, "read_timeout": 5}
        return opts

    def add(self, action: str, method: str | None = None, path: str | None = None, **kw) -> Rule:
        rule = Rule(action, method, path, **kw)
        with self._lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        """Remove every rule and stop random faults."""
        with self._lock:
            self.rules.clear()
            self._chaos = {}

    def chaos(self, rates: dict[str, float], *, delay_s: float = 0.1, methods: set[str] | None = None,
              seed: int | None = None) -> None:
        """Inject faults at random: ``rates`` maps actions to probabilities per request (summing to <= 1)."""
        bad = set(rates) - set(ACTIONS)
        if bad or sum(rates.values()) > 1:
            raise ValueError(f"bad chaos rates {rates}")
        with self._lock:
            self._chaos = dict(rates)
            self._chaos_delay_s = delay_s
            self._chaos_methods = methods
            if seed is not None:
                self._rng.seed(seed)

    def start(self) -> FaultProxy:
        self._serve(0)
        return self

    def _serve(self, port: int) -> None:
        proxy = self

        class Handler(_Handler):
            owner = proxy

        server = _Server(("127.0.0.1", port), Handler)
        server.daemon_threads = True
        self._server = server
        self.port = server.server_address[1]
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True,
                                        name="faultproxy")
        self._thread.start()

    def down(self) -> None:
        """Close the listening socket and every open connection: the endpoint is down (connections refused)."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        with self._lock:
            self.stats["down"] += 1
            conns, self._conns = list(self._conns), set()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def up(self) -> None:
        """Listen again on the same port."""
        if self._server is None:
            self._serve(self.port)

    def stop(self) -> None:
        self.down()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ per request
    def _decide(self, method: str, path: str) -> tuple[str | None, Rule | None]:
        with self._lock:
            self.stats["requests"] += 1
            self.stats[f"requests.{method}"] += 1
            for rule in self.rules:
                if rule.matches(method, path):
                    return rule.action, rule
            if self._chaos and (self._chaos_methods is None or method in self._chaos_methods):
                u = self._rng.random()
                for action, p in self._chaos.items():
                    if u < p:
                        return action, None
                    u -= p
        return None, None

    def _note(self, method: str, path: str, action: str) -> None:
        with self._lock:
            self.stats[action] += 1
            self.log.append((method, path, action))


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:  # clients reset connections on purpose here
        pass


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    owner: FaultProxy

    def log_message(self, *args) -> None:  # quiet
        pass

    def setup(self) -> None:
        super().setup()
        with self.owner._lock:
            self.owner._conns.add(self.connection)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            with self.owner._lock:
                self.owner._conns.discard(self.connection)

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(out)
                out.append(self.rfile.read(size))
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _reset(self) -> None:
        self.close_connection = True
        try:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
        except OSError:
            pass

    def _send(self, status: int, headers: list[tuple[str, str]], body: bytes, head: bool) -> None:
        self.send_response_only(status)
        for k, v in headers:
            if k.lower() not in _HOP and k.lower() != "content-length":
                self.send_header(k, v)
        self.send_header("Content-Length", dict((k.lower(), v) for k, v in headers).get("content-length", str(len(body)))
                         if head else str(len(body)))
        self.end_headers()
        if not head and body:
            self.wfile.write(body)

    def _error(self, code: str, head: bool) -> None:
        body = _error_body(code)
        self._send(_STATUS.get(code, 503), [("Content-Type", "application/xml")], b"" if head else body, head)

    def _forward(self, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        conn = getattr(self, "_upstream", None)
        for attempt in range(2):  # a kept-alive upstream connection may have been closed by moto: reconnect once
            if conn is None:
                conn = http.client.HTTPConnection(*self.owner.upstream, timeout=60)
                self._upstream = conn
            try:
                conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for k, v in self.headers.items():
                    if k.lower() not in _HOP and k.lower() != "content-length":
                        conn.putheader(k, v)
                if body or self.command in ("PUT", "POST"):
                    conn.putheader("Content-Length", str(len(body)))
                conn.endheaders(body or None)
                resp = conn.getresponse()
                data = resp.read()
                return resp.status, resp.getheaders(), data
            except (ConnectionError, http.client.HTTPException, OSError):
                conn.close()
                conn = None
                self._upstream = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _handle(self) -> None:
        owner = self.owner
        if owner._server is None:  # down: a connection accepted just before
            return self._reset()
        head = self.command == "HEAD"
        action, rule = owner._decide(self.command, self.path)
        body = self._body()
        if action is not None:
            owner._note(self.command, self.path, action)
        delay = rule.delay_s if rule is not None else owner._chaos_delay_s
        code = rule.code if rule is not None else "SlowDown"
        if action == "error":
            return self._error(code, head)
        if action == "reset":
            return self._reset()
        if action == "delay":
            time.sleep(delay)
        status, headers, data = self._forward(body)
        if action == "apply_error":
            return self._error(code, head)
        if action == "apply_reset":
            return self._reset()
        if action == "apply_delay":
            time.sleep(delay)
        self._send(status, headers, data, head)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle


def no_s3fs_retries(monkeypatch) -> None:
    """Make s3fs try each request once (its retry count is the class attribute ``S3FileSystem.retries``)."""
    import s3fs

    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)


def chaos_run(url: str, options: dict, proxy: FaultProxy, *, trajectories: int, tokens: int, rates: dict,
              seed: int = 0, gc_grace_s: float = 4.0, step: int = 16, retry=None, log=None) -> dict:
    """A writer, a tailing reader and gc in parallel on one S3 store while ``proxy`` injects random faults.

    The writer retries every failed write/flush (its rows stay buffered); the reader tails the log from a cursor
    and, after a storage error, resumes from its last cursor; gc runs in a loop with the store's grace period.
    Afterwards (faults off) everything is checked: every token of every trajectory committed exactly once and
    readable with the right bytes, the tail saw every record exactly once in log order, no false conflict (lost
    race) was reported, gc deleted no committed segment and never saw a hole, verify is clean.
    Returns counts (requests, faults by kind, commits, retries, ...) and ``problems`` (empty when all held).
    """
    import tracestore as ts
    from helpers.store import check_batch, rows

    say = log or (lambda *a: None)
    retry = retry or ts.RetryPolicy(attempts=6, base_delay_s=0.02, max_delay_s=0.2, deadline_s=20)
    store = ts.create_store(url, [ts.Site("s0", 256), ts.Site("s1", 128)], moe_layers=["m0"], top_k=2,
                            num_experts=8, storage_options=options, retry=retry, chunk_rows=16, shard_bytes=4096,
                            gc_grace_s=gc_grace_s)
    problems: list[str] = []
    counts: Counter = Counter()
    done = threading.Event()
    seen: list[tuple[int, int, str, int, int]] = []  # (seq, index, traj, start, stop) as the tail yielded them

    def writer_loop() -> None:
        w = store.writer("chaos-writer", commit_bytes=6000, commit_interval_s=0, commit_timeout_s=10)
        for t in range(trajectories):
            traj = f"traj-{t}"
            for pos in range(0, tokens, step):
                stop = min(tokens, pos + step)
                start = pos
                for attempt in range(200):
                    try:
                        w.write(traj, start, **rows(store, traj, start, stop))
                        break
                    except ts.OverlapError as e:
                        problems.append(f"writer: false conflict {e}")
                        break
                    except ts.TransientStorageError as e:
                        counts["writer_retries"] += 1
                        start = e.buffered_to  # what this write buffered before the error stays buffered
                        if start >= stop:
                            break
                        time.sleep(0.01)
                else:
                    problems.append(f"writer: gave up on {traj}[{pos}:{stop})")
        while True:
            try:
                w.close()
                break
            except ts.OverlapError as e:
                problems.append(f"writer: false conflict at close {e}")
                break
            except ts.TransientStorageError:
                counts["writer_retries"] += 1
                time.sleep(0.01)
        counts["lost_races"] = w.stats["lost_races"]
        counts["commits"] = w.stats["segments"]

    def reader_loop() -> None:
        cursor = None
        rs = ts.open_store(url, storage_options=options, retry=retry)
        idle_after_done = 0
        while True:
            try:
                stream = rs.stream(cursor, timeout_s=0.3, poll_interval_s=0.02)
                for rec in stream:
                    seq, index = rec.seq, rec.index
                    batch = stream.read(rec, fmt="numpy")
                    check_batch(store, batch, rec.traj_id, rec.token_start, rec.token_stop)
                    seen.append((seq, index, rec.traj_id, rec.token_start, rec.token_stop))
                    cursor = stream.cursor
                cursor = stream.cursor
                if done.is_set():
                    idle_after_done += 1
                    if idle_after_done >= 3:
                        return
            except ts.TransientStorageError:
                counts["reader_retries"] += 1
            except ts.IntegrityError as e:
                if "missing" in str(e) and "log entry" not in str(e):
                    counts["reader_read_missing"] += 1  # a gc race would show here; checked at the end
                problems.append(f"reader: {type(e).__name__}: {e}")
                return
            except AssertionError as e:
                problems.append(f"reader: wrong bytes {e}")
                return

    def gc_loop() -> None:
        gs = ts.open_store(url, storage_options=options, retry=retry)
        while not done.is_set():
            try:
                rep = ts.collect_garbage(gs)
                counts["gc_runs"] += 1
                counts["gc_deleted_segments"] += len(rep.deleted_segments)
            except ts.GcRefusedError:
                counts["gc_refused"] += 1
            except ts.TransientStorageError:
                counts["gc_storage_errors"] += 1
            except ts.IntegrityError as e:
                problems.append(f"gc: {e}")
            time.sleep(0.2)

    proxy.chaos(rates, seed=seed)
    before = proxy.stats["requests"]
    threads = [threading.Thread(target=f, name=f.__name__) for f in (reader_loop, gc_loop)]
    for th in threads:
        th.start()
    t0 = time.monotonic()
    writer_loop()
    done.set()
    for th in threads:
        th.join(timeout=120)
        if th.is_alive():
            problems.append(f"{th.name} did not finish")
    counts["seconds"] = round(time.monotonic() - t0, 1)
    proxy.clear()
    counts["requests"] = proxy.stats["requests"] - before
    for k in ACTIONS:
        counts[f"faults.{k}"] = proxy.stats[k]

    final = ts.open_store(url, storage_options=options)
    report = ts.verify(final)
    if not report.ok:
        problems.append(f"verify: {report.errors[:3]}")
    counts["orphan_segments_left"] = len(report.orphan_segments)
    reader = final.reader()
    for t in range(trajectories):
        traj = f"traj-{t}"
        try:
            check_batch(store, reader.read(traj, 0, tokens, fmt="numpy"), traj, 0, tokens)
        except (ts.TraceStoreError, AssertionError) as e:
            problems.append(f"final read {traj}: {type(e).__name__}: {e}")
    entries = final.read_entries(0, final.head())
    committed = [(e.seq, k, t, a, b) for e in entries for k, (t, a, b, _ro, _pv) in enumerate(e.records())]
    counts["log_entries"] = final.head()
    counts["gc_entries"] = sum(e.kind == "gc" for e in entries)
    counts["records"] = len(committed)
    if seen != committed:
        problems.append(f"tail saw {len(seen)} records, the log has {len(committed)} (exactly once, in order)")
    # the only other claimant of log positions is gc (its gc entries, FORMAT §6): each race the one writer lost is
    # a position a gc entry took; more would be the writer mistaking its own landed entry for another's
    if counts["lost_races"] > counts["gc_entries"]:
        problems.append(f"writer reported {counts['lost_races']} lost races, more than the {counts['gc_entries']} gc "
                        "entries (no other writer)")
    say(dict(counts), problems)
    return {"counts": dict(counts), "problems": problems}
