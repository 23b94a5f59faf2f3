"""A reader of tracerl's artifacts written from schemas/ARTIFACTS.md alone loads what tracerl's trainer wrote.

The reader (everything above the tests) imports nothing of tracerl or tracestore: JSON, CRC-32C, NumPy for the
safetensors blob, and torch.distributed.checkpoint for the checkpoint's tensors, as the page says. The tests run
tracerl's trainer for a step and compare what the reader loads with the trainer's own tensors."""

from __future__ import annotations

import json
import os
import re
import struct

import crc32c
import numpy as np
import pytest
import torch

SPEC_FORMATS = (1, 2, 3)
_HEX = {"sha256": re.compile(r"[0-9a-f]{64}"), "crc32c": re.compile(r"[0-9a-f]{8}")}


class SpecError(Exception):
    """What the page calls an integrity or format error."""


# ---------------------------------------------------------------------------------------------- the reader (§1)

def crc_hex(data: bytes) -> str:
    return f"{crc32c.crc32c(data):08x}"


def commit_fields(raw: bytes, kind: str) -> tuple[int, dict]:
    """(format_version, fields) of a commit object (§1): kind, then format, then the checksum, then the fields."""
    obj = json.loads(raw.decode("utf-8"))
    if not isinstance(obj, dict) or obj.get("kind") != kind:
        raise SpecError(f"not a {kind} object")
    fv = obj.get("format_version")
    if fv not in SPEC_FORMATS or isinstance(fv, bool):
        raise SpecError(f"format_version {fv!r}")
    if fv < 3:
        return fv, {k: v for k, v in obj.items() if k not in ("kind", "format_version")}
    text = obj["fields"]
    if crc_hex(text.encode("utf-8")) != obj["fields_crc32c"]:
        raise SpecError("fields checksum")
    fields = json.loads(text)
    assert "kind" not in fields and "format_version" not in fields
    return fv, fields


def checked_blob(root: str, ref: dict, area: str, number: int, suffix: str, fv: int) -> bytes:
    """A referenced blob's bytes, after its key's form, size and checksum are checked (§1)."""
    algo = "sha256" if fv == 1 else "crc32c"
    h = ref[algo]
    assert _HEX[algo].fullmatch(h)
    if ref["key"] != f"{area}/{number:012d}-{h[:16]}{suffix}":
        raise SpecError(f"key {ref['key']!r}")
    with open(os.path.join(root, ref["key"]), "rb") as f:
        data = f.read()
    if len(data) != ref["bytes"]:
        raise SpecError("size")
    if algo == "crc32c" and crc_hex(data) != h:
        raise SpecError("blob checksum")
    return data


_ST_DTYPES = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32, "F64": np.float64, "I64": np.int64,
              "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def safetensors(data: bytes) -> tuple[dict, dict]:
    """(name -> NumPy array, bf16 as its uint16 bits; the metadata) of a safetensors file (§2)."""
    (n,) = struct.unpack("<Q", data[:8])
    assert n % 8 == 0
    header = json.loads(data[8:8 + n])
    meta = header.pop("__metadata__", {})
    body = data[8 + n:]
    spans, out = [], {}
    for name, e in header.items():
        b, end = e["data_offsets"]
        spans.append((b, end))
        out[name] = np.frombuffer(body[b:end], dtype=_ST_DTYPES[e["dtype"]]).reshape(e["shape"])
    spans.sort()
    assert spans[0][0] == 0 and spans[-1][1] == len(body) and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    return out, meta


def read_version(root: str, version: int) -> tuple[dict, dict, dict]:
    """(sidecar fields, tensors, safetensors metadata) of a policy version (§2)."""
    with open(os.path.join(root, "weights", f"{version:012d}.json"), "rb") as f:
        fv, side = commit_fields(f.read(), "tracerl.weights")
    assert side["version"] == version
    blob = checked_blob(root, side, "weights", version, ".safetensors", fv)
    tensors, meta = safetensors(blob)
    assert len(tensors) == side["tensors"]
    return side, tensors, meta


def committed_versions(root: str) -> list[int]:
    return sorted(int(n[:12]) for n in os.listdir(os.path.join(root, "weights")) if re.fullmatch(r"\d{12}\.json", n))


def read_checkpoint(root: str, step: int) -> tuple[dict, dict, dict]:
    """(manifest fields, model: name -> fp32 array, optim: name -> {step, exp_avg, exp_avg_sq}) of a format-3
    checkpoint (§3): every listed file checked, then the tensors loaded with torch.distributed.checkpoint."""
    import torch.distributed.checkpoint as dcp

    with open(os.path.join(root, "checkpoints", f"{step:012d}.json"), "rb") as f:
        fv, man = commit_fields(f.read(), "tracerl.checkpoint")
    assert fv == 3 and man["step"] == step
    t = man["tensors"]
    assert re.fullmatch(rf"checkpoints/{step:012d}-[0-9a-f]{{12}}\.dcp", t["dir"])
    d = os.path.join(root, t["dir"])
    assert set(os.listdir(d)) == set(t["files"])
    for name, ref in t["files"].items():
        with open(os.path.join(d, name), "rb") as f:
            data = f.read()
        if len(data) != ref["bytes"] or crc_hex(data) != ref["crc32c"]:
            raise SpecError(f"checkpoint file {name}")
    md = dcp.FileSystemReader(d).read_metadata().state_dict_metadata
    flat = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.items()}
    dcp.load(flat, checkpoint_id=d)  # one process, no process group: the whole tensors
    model = {k.removeprefix("model."): v.numpy() for k, v in flat.items() if k.startswith("model.")}
    optim: dict = {}
    for k, v in flat.items():
        if k.startswith("optim."):
            name, field = k.removeprefix("optim.").rsplit(".", 1)
            optim.setdefault(name, {})[field] = v.numpy()
    return man, model, optim


def digest(arrays: list[np.ndarray]) -> str:
    """The weights' digest (§3), in NumPy: wrapping int64 sums of bits times odd position weights, then SHA-256."""
    import hashlib

    sums = []
    for a in arrays:
        flat = np.ascontiguousarray(a).reshape(-1)
        kind = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[flat.itemsize]
        bits = flat.view(kind).astype(np.int64)
        i = np.arange(flat.size, dtype=np.int64)
        w = (i * 2654435761 % (2**61 - 1)) * 2 + 1
        with np.errstate(over="ignore"):
            sums.append(np.sum(bits * w, dtype=np.int64))
    shapes = json.dumps([list(a.shape) for a in arrays]).encode()
    return hashlib.sha256(np.array(sums, dtype="<i8").tobytes() + shapes).hexdigest()[:32]


def bf16_bits(fp32: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even of finite fp32 values to bf16, as uint16 bits."""
    u = fp32.view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


# ------------------------------------------------------------------------------------------------------ the tests

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A store whose trainer took 2 steps: policy versions 0-2 in the store, checkpoints 1 and 2 beside it."""
    from helpers import loop
    from tracerl.artifacts import weights
    from tracerl.policy import build_policy
    from tracerl.rollout import run_rollout
    from tracerl.runlog import MetricsLog
    from tracerl.train import run_training, start_or_resume

    tmp = tmp_path_factory.mktemp("spec")
    store = loop.create(str(tmp / "store"))
    weights.publish(store.url, 0, build_policy(store.model).model.state_dict())
    with loop.worker(store, max_ahead=2) as w:
        run_rollout(w, metrics=MetricsLog(None), max_batches=2)
    ck, log = str(tmp / "ckpt"), MetricsLog(None)
    trainer, follower = start_or_resume(store, loop.train_cfg(max_staleness=2), checkpoints=ck, weights_url=store.url,
                                        metrics=log)
    assert run_training(trainer, follower, checkpoints=ck, weights_url=store.url, metrics=log, max_steps=2,
                        wait_timeout_s=60) == 2
    return str(tmp / "store"), ck, trainer


def test_policy_versions_load_as_the_trainer_published_them(trained):
    root, _, trainer = trained
    assert committed_versions(root) == [0, 1, 2]
    side, tensors, meta = read_version(root, 2)
    assert meta == {"tracerl.version": "2"} and side["step"] == 2 and side["parent_version"] == 1
    assert side["meta"]["digest"] == trainer.digest()
    sd = trainer.model.state_dict()
    assert set(tensors) == set(sd)
    for name, t in sd.items():
        mine = t.detach().cpu()
        want = mine.view(torch.int16).numpy().view(np.uint16) if mine.dtype == torch.bfloat16 else mine.numpy()
        assert tensors[name].shape == tuple(mine.shape) and np.array_equal(tensors[name], want), name


def test_checkpoint_loads_and_its_digest_matches(trained):
    _, ck, trainer = trained
    man, model, optim = read_checkpoint(ck, 2)
    state = man["state"]
    assert state["step"] == 2 and state["version"] == 2 and state["optim_initialized"]
    assert man["blobs"] == {} and man["tensors"]["world_size"] == 1
    names = [n for n, _ in trainer.model.named_parameters()]
    assert list(model) == names  # the metadata keeps parameter order
    assert digest([model[n] for n in names]) == state["digest"] == trainer.digest()
    assert set(optim) == set(names)
    for n in names:
        assert set(optim[n]) == {"step", "exp_avg", "exp_avg_sq"}
        assert optim[n]["exp_avg"].shape == model[n].shape and float(optim[n]["step"]) == 2.0
    # the published version 2 is the rounding of the checkpoint's fp32 weights
    _, tensors, _ = read_version(os.path.dirname(ck) + "/store", 2)
    for n in names:
        assert np.array_equal(bf16_bits(model[n]), tensors[n]), n
    # the follower state the page lists
    assert set(state["follower"]) >= {"cursor", "pending", "open", "ready", "counts", "set_aside"}


def test_reader_refuses_a_flipped_digit_in_the_fields(trained, tmp_path):
    root, _, _ = trained
    with open(os.path.join(root, "weights", f"{2:012d}.json"), "rb") as f:
        raw = f.read()
    obj = json.loads(raw)
    text = obj["fields"].replace('"step": 2', '"step": 3')
    assert text != obj["fields"]
    with pytest.raises(SpecError, match="fields checksum"):
        commit_fields(json.dumps({**obj, "fields": text}).encode(), "tracerl.weights")
