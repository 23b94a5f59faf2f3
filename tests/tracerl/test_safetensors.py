"""`tracerl.artifacts.tensorfile` against the safetensors library itself: files it encodes load with the library, files
the library saves decode here, bit for bit, every dtype the policy weights use; malformed files are typed errors."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load as lib_load
from safetensors.torch import save as lib_save

from tracerl.artifacts import tensorfile as st
from tracerl.errors import ConfigError


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {
        "bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "f16": torch.randn(7, generator=g).to(torch.float16),
        "f32": torch.randn(2, 3, 4, generator=g),
        "f64": torch.randn(3, generator=g, dtype=torch.float64),
        "i64": torch.randint(-(2**62), 2**62, (4,), generator=g),
        "i32": torch.randint(-(2**31), 2**31 - 1, (5,), generator=g, dtype=torch.int32),
        "i16": torch.randint(-(2**15), 2**15 - 1, (3,), generator=g, dtype=torch.int16),
        "i8": torch.randint(-128, 127, (9,), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 255, (2, 2), generator=g, dtype=torch.uint8),
        "bool": torch.rand(6, generator=g) > 0.5,
        "f8": torch.randn(8, generator=g).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "special": torch.tensor([float("nan"), -float("nan"), float("inf"), -0.0], dtype=torch.bfloat16),
    }
    return out


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype, a.shape) == (b.dtype, b.shape) and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                       b.reshape(-1).view(torch.uint8))


def test_our_files_load_with_the_library():
    sd = _tensors()
    blob = b"".join(bytes(p) for p in st.encode(sd, {"tracerl.version": "7"}))
    got = lib_load(blob)
    assert set(got) == set(sd) and all(_bits_equal(got[k], sd[k]) for k in sd)


def test_library_files_decode_here(tmp_path):
    sd = _tensors()
    blob = lib_save(sd, metadata={"a": "b"})
    got, meta = st.decode(blob)
    assert meta == {"a": "b"} and set(got) == set(sd) and all(_bits_equal(got[k], sd[k]) for k in sd)
    got["f32"] += 1  # fresh, writable tensors: the blob is untouched
    assert st.decode(blob)[0]["f32"].equal(sd["f32"])
    path = tmp_path / "x.safetensors"
    path.write_bytes(b"".join(bytes(p) for p in st.encode(sd, {"k": "v"})))
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"k": "v"} and _bits_equal(f.get_tensor("bf16"), sd["bf16"])


def test_encode_refuses_what_the_library_refuses():
    shared = torch.zeros(4, 4)
    with pytest.raises(ValueError, match="share memory"):
        st.encode({"a": shared, "b": shared})
    with pytest.raises(ValueError, match="share memory"):
        st.encode({"a": shared, "b": shared[1]})
    st.encode({"a": shared[0], "b": shared[1]})  # disjoint views of one storage are two tensors
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        st.encode({"a": torch.zeros(4, 4).t()})
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        st.encode({"a": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(ValueError, match="metadata"):
        st.encode({"a": torch.zeros(1)}, {"k": 1})


def _file(header: dict, data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


@pytest.mark.parametrize("blob, match", [
    (b"\x01\x02", "shorter"),
    (struct.pack("<Q", 10**12) + b"{}", "does not fit"),
    (struct.pack("<Q", 4) + b"{no}", "not JSON"),
    (_file([1, 2]), "not a JSON object"),
    (_file({"a": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, bytes(8)), "dtype"),
    (_file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, bytes(4)), "4 bytes for shape"),
    (_file({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 8]}}, bytes(4)), "within"),
    (_file({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, bytes(4)), "within"),
    (_file({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, bytes(8)), "starts at 4"),
    (_file({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, bytes(8)), "cover 4 of the 8"),
    (_file({"__metadata__": {"k": 1}}), "__metadata__"),
])
def test_malformed_files_are_typed_errors(blob, match):
    with pytest.raises(st.SafetensorsFormatError, match=match):
        st.decode(blob)
    with pytest.raises(st.SafetensorsFormatError, match=match):
        st.decode_views(torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.zeros(0, dtype=torch.uint8))
    with pytest.raises(st.SafetensorsFormatError, match=match):
        st.decode_numpy(blob)


@pytest.mark.parametrize("source", ["ours", "library"])
def test_decode_views_shares_the_buffer_and_equals_decode(source):
    """Views of one buffer, bit for bit what `decode` copies out, for our files and the library's (both align every
    tensor to its element size), the buffer a slice of a larger one too."""
    sd = _tensors()
    blob = (b"".join(bytes(p) for p in st.encode(sd)) if source == "ours" else lib_save(sd))
    big = torch.zeros(len(blob) + 16, dtype=torch.uint8)
    buf = big[8:8 + len(blob)]
    buf.copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
    views, _ = st.decode_views(buf)
    copies, _ = st.decode(blob)
    assert set(views) == set(sd) and all(_bits_equal(views[k], copies[k]) for k in sd)
    shared = [k for k, t in views.items() if t.numel()]
    assert shared and all(views[k].untyped_storage().data_ptr() == big.untyped_storage().data_ptr() for k in shared)
    views["f32"].add_(1)  # writes the buffer, not the other tensors
    assert all(_bits_equal(views[k], copies[k]) for k in sd if k != "f32")


def test_decode_views_copies_a_tensor_not_aligned_to_its_element_size():
    raw = _file({"u": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
                 "f": {"dtype": "F32", "shape": [2], "data_offsets": [3, 11]}},
                b"\x01\x02\x03" + struct.pack("<2f", 1.5, -2.0))
    buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    views, _ = st.decode_views(buf)
    assert views["f"].tolist() == [1.5, -2.0] and views["u"].tolist() == [1, 2, 3]
    assert views["f"].untyped_storage().data_ptr() != buf.untyped_storage().data_ptr()  # copied out
    with pytest.raises(ConfigError, match="contiguous uint8"):
        st.decode_views(buf.view(torch.int8))
    with pytest.raises(ConfigError, match="contiguous uint8"):
        st.decode_views(buf[::2])


def _file(header: dict | bytes, data: bytes = b"") -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


@pytest.mark.parametrize("header, match", [
    ({"a": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}, "dtype"),  # a list: was an untyped TypeError
    ({"a": {"dtype": "F32", "shape": [2**40, 2**40, 2**40], "data_offsets": [0, 4]}}, "bytes for shape"),
    ({"a": {"dtype": "F32", "shape": [{"x": 1}], "data_offsets": [0, 4]}}, "shape"),
    (b"[" * 100_000 + b"]" * 100_000, "nests 100000 levels"),  # was a RecursionError
    (b'{"a": ' + b'{"b": ' * 5 + b"1" + b"}" * 6, "nests"),
])
def test_hostile_headers_are_typed_errors(header, match):
    with pytest.raises(st.SafetensorsFormatError, match=match):
        st.decode(_file(header, b"\0" * 4))


def test_many_entries_over_one_range_fail_before_any_copy():
    """1,000 entries over one 1 MiB range: every entry was allocated and copied (1 GB) before the tiling was checked
    (it did not finish in 240 s); now the tiling is checked first, memory bounded by the file."""
    import time

    n = 1 << 20
    header = {f"t{i}": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]} for i in range(1000)}
    t0 = time.perf_counter()
    with pytest.raises(st.SafetensorsFormatError, match="starts at 0, the previous data ends at"):
        st.decode(_file(header, b"\0" * n))
    assert time.perf_counter() - t0 < 5


@pytest.mark.parametrize("source", ["ours", "library"])
def test_decode_numpy_views_the_blob_and_equals_the_library(source):
    """`decode_numpy`: every array numpy has a dtype for equals the library's ``safetensors.numpy`` load, is a
    read-only view of the blob (no copy), and a dtype numpy lacks (BF16, F8) is a typed error naming it."""
    from safetensors.numpy import load as np_load

    sd = {k: v for k, v in _tensors().items() if v.dtype not in (torch.bfloat16, torch.float8_e4m3fn)}
    blob = lib_save(sd) if source == "library" else b"".join(bytes(p) for p in st.encode(sd, {"k": "v"}))
    got, meta = st.decode_numpy(blob)
    want = np_load(blob)
    assert set(got) == set(want) and meta == ({} if source == "library" else {"k": "v"})
    for k, a in got.items():
        assert a.dtype == want[k].dtype and a.shape == want[k].shape
        assert a.tobytes() == want[k].tobytes()
        assert not a.flags.writeable and (a.size == 0 or np.shares_memory(a, np.frombuffer(blob, np.uint8)))
    with pytest.raises(st.SafetensorsFormatError, match="BF16"):
        st.decode_numpy(lib_save({"w": torch.zeros(2, dtype=torch.bfloat16)}))
