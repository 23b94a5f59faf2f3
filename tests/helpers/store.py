"""Test helpers for the store suite: raw access to each backend that does not go through tracestore, and
deterministic row data."""

from __future__ import annotations

import hashlib
import os
import threading
import time

import numpy as np


class Raw:
    """A store location: ``url`` / ``options`` for tracestore, and raw list/read/write/delete for checks."""

    url: str
    options: dict | None = None

    def keys(self) -> list[str]:
        raise NotImplementedError

    def read(self, key: str) -> bytes:
        raise NotImplementedError

    def write(self, key: str, data: bytes) -> None:
        raise NotImplementedError

    def delete(self, key: str) -> None:
        raise NotImplementedError

    def snapshot(self) -> dict[str, bytes]:
        """Every object's bytes, keyed by relative key (to prove a store is unchanged)."""
        return {k: self.read(k) for k in self.keys()}

    def flip(self, key: str, offset: int) -> None:
        data = bytearray(self.read(key))
        data[offset] ^= 0x01
        self.write(key, bytes(data))


class RawLocal(Raw):
    def __init__(self, root: str):
        self.root = root
        self.url = root
        self.options = None

    def keys(self) -> list[str]:
        out = []
        for d, _, files in os.walk(self.root):
            for f in files:
                out.append(os.path.relpath(os.path.join(d, f), self.root).replace(os.sep, "/"))
        return sorted(out)

    def read(self, key: str) -> bytes:
        with open(os.path.join(self.root, key), "rb") as f:
            return f.read()

    def write(self, key: str, data: bytes) -> None:
        path = os.path.join(self.root, key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)

    def delete(self, key: str) -> None:
        os.unlink(os.path.join(self.root, key))

    def set_mtime(self, key: str, t: float) -> None:
        os.utime(os.path.join(self.root, key), (t, t))


class RawMemory(Raw):
    def __init__(self, url: str):
        from tracestore.storage import _memory

        self.url = url
        self.options = None
        self._mod = _memory
        self._objects = _memory._STORES.setdefault(url, {})

    def keys(self) -> list[str]:
        return sorted(self._objects)

    def read(self, key: str) -> bytes:
        return self._objects[key][0]

    def write(self, key: str, data: bytes) -> None:
        self._objects[key] = (bytes(data), time.time())

    def delete(self, key: str) -> None:
        del self._objects[key]

    def set_mtime(self, key: str, t: float) -> None:
        self._objects[key] = (self._objects[key][0], t)

    def clear(self) -> None:
        self._mod.MemoryBackend.clear(self.url)


class RawS3(Raw):
    def __init__(self, bucket: str, prefix: str, client, options: dict):
        self.bucket, self.prefix, self.client = bucket, prefix, client
        self.url = f"s3://{bucket}/{prefix}"
        self.options = options

    def keys(self) -> list[str]:
        out = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix + "/"):
            out.extend(o["Key"][len(self.prefix) + 1:] for o in page.get("Contents", []))
        return sorted(out)

    def read(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}")["Body"].read()

    def write(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}", Body=data)

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}")


def race(put_if_absent, key: str, writers: int = 8) -> list[int]:
    """The writers (0 .. writers-1) whose ``put_if_absent(key, b"writer-<i>")`` returned True, all called at once
    from their own threads."""
    wins: list[int] = []

    def go(i: int) -> None:
        if put_if_absent(key, f"writer-{i}".encode()):
            wins.append(i)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return wins


def _seed(*parts) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")


def rows(store, traj_id: str, start: int, stop: int, policy_version: int = 0) -> dict:
    """Deterministic write() keyword arguments for tokens [start, stop) of ``traj_id`` (a pure function of
    (traj_id, position), so any slice can be regenerated to check a read)."""
    T = stop - start
    out = {"hints": {}, "scales": {}, "experts": {} if store.moe_layers else None, "policy_version": policy_version}
    pos = np.arange(start, stop)
    for name, site in store.sites.items():
        base = np.random.default_rng(_seed(traj_id, name)).integers(0, 256, (1, site.hint_bytes + site.scale_bytes),
                                                                     dtype=np.uint8)
        mat = (base + (pos[:, None] * 7 + np.arange(site.hint_bytes + site.scale_bytes)[None, :] * 3)).astype(np.uint8)
        out["hints"][name] = np.ascontiguousarray(mat[:, : site.hint_bytes])
        out["scales"][name] = np.ascontiguousarray(mat[:, site.hint_bytes:])
    tok_seed = _seed(traj_id) % 100_000
    out["token_ids"] = ((pos * 31 + tok_seed) % 150_000).astype(np.int64)
    out["logprobs"] = (-(pos % 97) / 13.0 - (tok_seed % 7)).astype(np.float32)
    for k, layer in enumerate(store.moe_layers):
        out["experts"][layer] = ((pos[:, None] * 5 + np.arange(store.top_k)[None, :] * 11 + k + tok_seed)
                                 % store.num_experts).astype(np.int64)
    assert T == len(pos)
    return out


def check_batch(store, batch, traj_id: str, start: int, stop: int, *, features=None, sites=None) -> None:
    """Assert that a numpy TraceBatch equals the deterministic rows (policy versions are not checked)."""
    want = rows(store, traj_id, start, stop)
    assert batch.start == start and batch.stop == stop
    np.testing.assert_array_equal(np.asarray(batch.positions), np.arange(start, stop))
    for name in (sites or store.sites):
        site = store.sites[name]
        lo, hi = features or (0, site.width)
        np.testing.assert_array_equal(np.asarray(batch.hints[name]), want["hints"][name][:, lo // 8: hi // 8])
        per = site.scale_values_per_byte  # block_size, or 8 blocks per byte with scale encoding lsb
        np.testing.assert_array_equal(np.asarray(batch.scales[name]), want["scales"][name][:, lo // per: -(-hi // per)])
    np.testing.assert_array_equal(np.asarray(batch.token_ids), want["token_ids"].astype(np.int32))
    np.testing.assert_array_equal(np.asarray(batch.logprobs), want["logprobs"])
    for layer in store.moe_layers:
        np.testing.assert_array_equal(np.asarray(batch.experts[layer]), want["experts"][layer])


def child_main(argv: list[str] | None = None) -> int:
    """A writer process for the multi-process and SIGKILL tests.

    ``python -c 'import helpers.store as h; h.child_main()' '<json spec>'``; spec keys: url, options,
    writer_id, trajs ([[traj_id, n_tokens], ...]), step, commit_bytes, skip_committed, delay_s.
    Prints "ready" once the writer is open; exits 0 when all tokens were written and committed.
    """
    import json
    import sys

    import tracestore as ts

    spec = json.loads((argv or sys.argv[1:])[0])
    store = ts.open_store(spec["url"], storage_options=spec.get("options"))
    w = store.writer(spec["writer_id"], commit_bytes=spec.get("commit_bytes", 2000), commit_interval_s=0,
                     skip_committed=spec.get("skip_committed", True))
    print("ready", flush=True)
    step = spec.get("step", 7)
    for traj, n in spec["trajs"]:
        for pos in range(0, n, step):
            stop = min(n, pos + step)
            try:
                w.write(traj, pos, **rows(store, traj, pos, stop))
            except ts.OverlapError:
                pass  # another writer committed these positions first (or a flush lost a race)
            if spec.get("delay_s"):
                time.sleep(spec["delay_s"])
    try:
        w.close()
    except ts.OverlapError:
        pass
    print("done", flush=True)
    return 0


def store_with_manifest_sites(tmp_path, version: int, site: dict) -> str:
    """The URL of a store at ``tmp_path / "s"`` of format ``version`` whose manifest's site table was rewritten to
    the one site object ``site`` (as a writer of another implementation, or a damaged file, could leave it)."""
    import json

    import tracestore as ts

    url = str(tmp_path / "s")
    ts.create_store(url, [ts.Site("a", 64)], format_version=version)
    path = tmp_path / "s" / "tracestore.json"
    m = json.loads(path.read_text())
    m["sites"] = [site]
    path.write_text(json.dumps(m))
    return url
