"""safetensors encoding and decoding that leave the GIL to other threads.

`safetensors.torch.save` and `load` hold the GIL for the whole copy: on the 2-core VM, saving 2.15 GB stopped every
other Python thread for 5.6 s and loading it for 1.2 s (`benchmarks/benchmark_weights.py`, medians of 3). The trainer publishes policy versions from a
background thread while it trains the next step, and the rollout reads new versions in a background thread while
it generates, so for a 9 GB policy those pauses land in the middle of training steps and decode loops.

The file format is the library's (https://huggingface.co/docs/safetensors: an 8-byte little-endian header length,
a JSON header of ``{name: {"dtype", "shape", "data_offsets"}, "__metadata__": {str: str}}`` padded with spaces to 8
bytes, then the tensors' bytes back to back); the tests check both directions against the library itself. Here
the blob is a list of parts (the header, then one memoryview of each tensor's bytes: nothing copied; `Backend.put`
writes parts with one gather write), checksums run over the parts (crc32c and sha256 release the GIL), and
decoding copies each tensor out of the blob with a torch copy, which releases the GIL (`decode`), or, for a blob
read into a buffer of its own, makes each tensor a view of that buffer (`decode_views`: no copy at all; a policy
version is loaded that way, `tracerl.artifacts.weights.load_state_dict`), or, for numpy, each array a view of the
blob itself (`decode_numpy`: the rollout's recorded codes, `tracerl.artifacts.codes`).
"""

from __future__ import annotations

import json
import math
import re
import struct
import warnings
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from tracerl.errors import ConfigError, SafetensorsFormatError

__all__ = ["encode", "decode", "decode_views", "decode_numpy", "SafetensorsFormatError"]

#: safetensors dtype names of the torch dtypes (the library's names)
_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_TORCH = {v: k for k, v in _DTYPES.items()}
_ITEMSIZE = {d: torch.empty((), dtype=d).element_size() for d in _DTYPES}
_MAX_HEADER = 100 << 20  # the library's bound on the header size


def encode(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> list:
    """The safetensors file of ``tensors`` (CPU tensors of the dtypes in ``_DTYPES``) as parts: ``[header bytes,
    memoryview, ...]`` whose concatenation is the file. The memoryviews alias the tensors' storage: keep the
    tensors unchanged until the parts are written. Tensors are laid out by descending element size, then name
    (every tensor aligned to its element size, as the library does).

    Raises ValueError for a non-CPU, non-contiguous or unsupported-dtype tensor, or metadata that is not str -> str.
    """
    meta = dict(metadata or {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise ConfigError("safetensors metadata must map str to str")
    for name, t in tensors.items():
        if not isinstance(name, str) or name == "__metadata__":
            raise ConfigError(f"tensor name {name!r}: must be a str other than '__metadata__'")
        if t.device.type != "cpu" or not t.is_contiguous() or t.dtype not in _DTYPES:
            raise ConfigError(f"tensor {name!r}: needs a contiguous CPU tensor of {sorted(_DTYPES.values())}, got "
                             f"{t.dtype} on {t.device}{'' if t.is_contiguous() else ', not contiguous'}")
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), name)
                   for name, t in tensors.items() if t.numel())
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
        if begin < end:  # as the library: a file holds each byte once (tied weights: publish one of them)
            raise ConfigError(f"tensors {a!r} and {b!r} share memory; safetensors stores each tensor's bytes once")
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header: dict = {"__metadata__": meta} if meta else {}
    views, offset = [], 0
    for name in order:
        t = tensors[name]
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        if n:
            views.append(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return [struct.pack("<Q", len(raw)) + raw, *views]


def _layout(mv: memoryview) -> tuple[dict[str, str], int, list[tuple[str, torch.dtype, list[int], int, int]]]:
    """(metadata, first data byte, checked entries) of the safetensors file in ``mv`` (see `decode`)."""
    if len(mv) < 8:
        raise SafetensorsFormatError(f"{len(mv)} bytes: shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", mv[:8])
    if n > _MAX_HEADER or 8 + n > len(mv):
        raise SafetensorsFormatError(f"header length {n} does not fit a file of {len(mv)} bytes")
    header = _parse_header(bytes(mv[8:8 + n]))
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise SafetensorsFormatError("__metadata__ is not a str -> str object")
    return meta, 8 + n, _check_entries(header, len(mv) - 8 - n)


def decode(blob: bytes | memoryview) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a safetensors file; every tensor is a fresh CPU tensor (copied out of ``blob``).

    Hostile bytes cost at most the file's size: the header's nesting is bounded before it is parsed, and every
    entry (dtype, shape, offsets) and the tiling of the data by the entries are checked before the first tensor is
    allocated, so the tensors together are exactly the data bytes.

    Raises SafetensorsFormatError when ``blob`` is not a well-formed safetensors file (truncated, a header that is
    not JSON or nests deeper than the format does, unknown dtypes, shapes that do not match their bytes, offsets
    that do not tile the data exactly)."""
    mv = memoryview(blob).cast("B")
    meta, start, entries = _layout(mv)
    data = mv[start:]
    out = {}
    for name, dtype, shape, begin, size in entries:
        t = torch.empty(shape, dtype=dtype)
        if size:
            with warnings.catch_warnings():  # read-only bytes: the tensor is only read from, then dropped
                warnings.simplefilter("ignore", UserWarning)
                src = torch.frombuffer(data, dtype=torch.uint8, count=size, offset=begin)
            t.view(-1).view(torch.uint8).copy_(src)  # torch copies release the GIL
        out[name] = t
    return out, meta


#: numpy dtypes of the safetensors dtypes numpy has (not BF16 / F8)
_NUMPY = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32, "I16": np.int16,
          "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def decode_numpy(blob: bytes | memoryview) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(arrays, metadata) of a safetensors file as numpy arrays that are views of ``blob`` (no copy: read-only
    when ``blob`` is ``bytes``; little-endian dtypes, possibly unaligned, which numpy reads as they are). The
    library's ``safetensors.numpy.load`` copies every array while holding the GIL (11-13 ms under cProfile for the
    43 MB of recorded codes a step of the 20-layer H100 run loads, in a background thread of a host-bound trainer:
    benchmarks/results/trainer-h100-l20/); this does microseconds of Python.

    The same checks as `decode` before the first array is made; raises SafetensorsFormatError as it does, and for
    a dtype numpy does not have (BF16, F8_*)."""
    mv = memoryview(blob).cast("B")
    meta, start, entries = _layout(mv)
    out = {}
    for name, dtype, shape, begin, size in entries:
        np_dtype = _NUMPY.get(_DTYPES[dtype])
        if np_dtype is None:
            raise SafetensorsFormatError(f"tensor {name!r} is {_DTYPES[dtype]}, which numpy has no dtype for; "
                                         f"decode_numpy reads {', '.join(_NUMPY)}")
        out[name] = np.frombuffer(mv, dtype=np.dtype(np_dtype).newbyteorder("<"), count=size // _ITEMSIZE[dtype],
                                  offset=start + begin).reshape(shape)
    return out, meta


def decode_views(buf: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of the safetensors file held by ``buf`` (a contiguous uint8 [N] CPU tensor), as views
    of ``buf`` (no copy: they share its memory, and writing one writes the buffer), each tensor aligned to its
    element size in the file (as `encode` and the library lay them out) or else copied out. The same checks as
    `decode` before the first tensor is made; raises SafetensorsFormatError as it does, and ConfigError for a
    ``buf`` that is not a contiguous uint8 [N] CPU tensor."""
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.device.type != "cpu" or not buf.is_contiguous():
        raise ConfigError(f"decode_views needs a contiguous uint8 [N] CPU tensor, got {buf.dtype} "
                          f"{tuple(buf.shape)} on {buf.device}")
    meta, start, entries = _layout(memoryview(buf.numpy()))
    out = {}
    for name, dtype, shape, begin, size in entries:
        first = start + begin
        if size and (buf.storage_offset() + first) % _ITEMSIZE[dtype] == 0:
            out[name] = buf[first:first + size].view(dtype).view(shape)
        else:  # empty, or not aligned to its element size: a copy
            t = torch.empty(shape, dtype=dtype)
            if size:
                t.view(-1).view(torch.uint8).copy_(buf[first:first + size])
            out[name] = t
    return out, meta


#: the deepest a safetensors header nests: the header object > a tensor's entry > its shape or offsets list
_MAX_DEPTH = 3
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


def _parse_header(raw: bytes) -> dict:
    """The header's JSON object, its nesting checked first (a 100,000-deep array made json.loads recurse)."""
    bare = np.frombuffer(_STRING.sub(b'""', raw), dtype=np.uint8)
    step = ((bare == ord("{")) | (bare == ord("["))).astype(np.int64) - ((bare == ord("}")) | (bare == ord("]")))
    depth = int(np.cumsum(step).max()) if step.size else 0
    if depth > _MAX_DEPTH:
        raise SafetensorsFormatError(f"the header nests {depth} levels deep; a safetensors header nests "
                                     f"{_MAX_DEPTH} (an object of entries with shape and offset lists)")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsFormatError(f"the header is not JSON: {e}") from e
    if not isinstance(header, dict):
        raise SafetensorsFormatError("the header is not a JSON object")
    return header


def _check_entries(header: dict, nbytes: int) -> list[tuple[str, torch.dtype, list[int], int, int]]:
    """Every tensor entry checked against the ``nbytes`` data bytes, and their tiling of them: (name, dtype, shape,
    first byte, bytes) in data order. Raises SafetensorsFormatError for the first problem."""
    entries = []
    for name, e in header.items():
        if not isinstance(e, dict):
            raise SafetensorsFormatError(f"tensor {name!r:.80}: its entry is not an object")
        code, shape, offs = e.get("dtype"), e.get("shape"), e.get("data_offsets")
        dtype = _TORCH.get(code) if isinstance(code, str) else None
        if dtype is None:
            raise SafetensorsFormatError(f"tensor {name!r:.80}: dtype {code!r:.40} is not one of {sorted(_TORCH)}")
        if not _ints(shape) or not _ints(offs) or len(offs) != 2 or not 0 <= offs[0] <= offs[1] <= nbytes:
            raise SafetensorsFormatError(f"tensor {name!r:.80}: shape {shape!r:.80} / data_offsets {offs!r:.80} do "
                                         f"not describe bytes within the {nbytes} data bytes")
        size = math.prod(shape) * _ITEMSIZE[dtype]  # Python integers: no overflow
        if offs[1] - offs[0] != size:
            raise SafetensorsFormatError(f"tensor {name!r:.80}: {offs[1] - offs[0]} bytes for shape {shape!r:.80} "
                                         f"of {code}")
        entries.append((name, dtype, list(shape), offs[0], size))
    entries.sort(key=lambda x: (x[3], x[3] + x[4]))
    end = 0
    for name, _, _, begin, size in entries:
        if begin != end:
            raise SafetensorsFormatError(f"tensor {name!r:.80} starts at {begin}, the previous data ends at {end}")
        end = begin + size
    if end != nbytes:
        raise SafetensorsFormatError(f"the tensors cover {end} of the {nbytes} data bytes")
    return entries


def _ints(xs: object) -> bool:
    return isinstance(xs, Sequence) and not isinstance(xs, str) and all(
        isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in xs)

