"""Engine-agnostic rollout recorder: per-step capture in, per-trajectory store writes out.

An engine (the reference engine here, the SGLang plugin later) calls, for each forward step:

    recorder.record_sites(request_ids, positions, site, hints, scales)     # per hinted site
    recorder.record_experts(request_ids, positions, layer, expert_ids)     # per MoE layer (optional)
    recorder.record_tokens(request_ids, positions, token_ids, logprobs)    # the tokens at those positions
    recorder.step()                                                        # end of the forward step

``request_ids`` (N strings) and ``positions`` (N ints, the token position in the request) are host data the
engine already has; the payloads are tensors [N, ...] on any device. The recorder never synchronizes per step:
payloads stay as device tensors until every ``drain_every`` steps, when they are concatenated per field and
copied to pinned host memory with ``non_blocking=True``; the copies are read once their CUDA event has fired
(``event.query()``, which does not wait). Host payloads (the prompt's tokens) never go to the device. Nothing
on this path reads a device value: no ``.item()``/``.cpu()``/``.tolist()``/``bool(t)``/``nonzero``, no
blocking copies; the only wait is `end` (the request's last rows must have arrived), on a CUDA event
(tests/tracerl/test_capture_sync.py checks this on CPU and on the meta device).

Per request the recorder buffers rows in a fixed-size arena slot (bounded memory) and writes a piece to the
sink as soon as ``flush_tokens`` leading rows are complete (every field present); ``end(request_id)`` writes
the rest. Rows that never received a site's data (an engine does not run a forward for the last sampled
token) are written with scale byte 0 and hint bits 0, which hint-guided dequantization maps to 0 and no real
NVFP4 block produces (the smallest block scale is 2^-9); missing expert ids are 255.

The sink is anything with tracestore's ``Writer.write`` signature (`TraceSink`); `MemorySink` keeps pieces in
memory and serves reads with the same slicing as the store's reader.

**Scale encodings.** A site whose store declares scale encoding ``lsb`` (FORMAT §2.4) keeps only each block's
scale-byte LSB: `record_sites` still takes the quantizer's E4M3 bytes [N, W/16] and packs them on their device
(`tracerl.hints.scalehints.pack_scale_lsb`, no host sync) into [N, ceil(W/128)], which is what is staged, copied to
the host and written. The encodings come from ``scale_encodings=`` or, by default, from the sink (a tracestore
``Writer``'s store, or a `MemorySink`'s own). Unfilled rows of such a site carry LSB 0 (there is no "no data"
byte: the trainer computes its own scale at such a row, a token whose activations no scored token reads).

**Margin sites.** A site that the sink's store declares with hint encoding ``margin`` (tracestore format 5, FORMAT
§2.5; `tracerl.hints.compact.store_site`) is recorded as margin-exception rows: `record_sites` then also takes the
activation ``x`` [N, W] and its ``global_scale``, and computes the value and block marks on their device
(``tracefp4.margin_marks``, no host sync) with the site's margins; marks, hints and scale bytes are staged and
copied like every other field, and when rows are written the recorder gathers the kept bits and bytes
(`compact.exceptions_from_marks`) and packs them in the site's coding (`compact.pack_rows`), on the host. When the
marks were computed on a CUDA device (``margin_pack="auto"``, the default; ``"device"`` does it on any device,
``"host"`` never) the staged rows are packed there instead (`compact_device.pack_sites_on_device`: the rows go over
from pinned memory, are packed on a side stream of the device with one sync for the packed size, and only the
packed bytes come back, data and offsets in one copy; the sites of one coding are packed in one call over their rows
stacked, so that is per write and coding, not per site), the same bytes as on the host. Unfilled rows carry no
marks (the trainer rounds to nearest there with its own scales). The engine passes ``x`` (hf decode path) or the
marks its static/graph step computed into its capture ring (``marks=``) only when asked
(`RolloutEngine(margin_capture=True)`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import torch

import tracefp4
from tracefp4.constants import HINTS_PER_BYTE, NVFP4_BLOCK_SIZE
from tracerl.errors import RecorderError
from tracerl.hints import compact, compact_device
from tracerl.hints.scalehints import SCALE_ENCODINGS, pack_scale_lsb, scale_lsb_bytes

NO_EXPERT = 255
#: where margin-site rows are packed (module docstring)
MARGIN_PACKS = ("auto", "device", "host")


class TraceSink(Protocol):
    """tracestore's ``Writer.write``: one token range of one trajectory, every declared site present."""

    def write(
        self,
        traj_id: str,
        token_start: int,
        *,
        hints: Mapping[str, np.ndarray],
        scales: Mapping[str, np.ndarray],
        token_ids: np.ndarray,
        logprobs: np.ndarray,
        experts: Mapping[str, np.ndarray] | None = None,
        policy_version: int = 0,
    ) -> None: ...


@dataclasses.dataclass
class TracePiece:
    hints: dict[str, np.ndarray]
    scales: dict[str, np.ndarray]
    token_ids: np.ndarray
    logprobs: np.ndarray
    experts: dict[str, np.ndarray]
    policy_version: np.ndarray
    positions: np.ndarray
    #: margin site -> its margin-exception rows (data uint8 [n], offsets int64 [T + 1]; `MemorySink` margin sites)
    rows: dict[str, tuple[np.ndarray, np.ndarray]] = dataclasses.field(default_factory=dict)


def _check_encodings(encodings: Mapping[str, str], site_widths: Mapping[str, int]) -> dict[str, str]:
    bad = {s: e for s, e in encodings.items() if e not in SCALE_ENCODINGS or s not in site_widths}
    if bad:
        raise RecorderError(f"scale encodings {bad}: each must be one of {list(SCALE_ENCODINGS)} for a recorded site "
                            f"({sorted(site_widths)[:4]}...)")
    return {s: encodings.get(s, "bytes") for s in site_widths}


def sink_scale_encodings(sink: Any, site_widths: Mapping[str, int]) -> dict[str, str]:
    """{site: scale encoding} that ``sink`` stores: a tracestore ``Writer``'s store sites, a `MemorySink`'s
    ``scale_encodings``, else ``bytes`` everywhere."""
    store = getattr(sink, "store", None)
    if store is not None and isinstance(getattr(store, "sites", None), Mapping):
        return _check_encodings({s: store.sites[s].scale_encoding for s in site_widths if s in store.sites},
                                site_widths)
    return _check_encodings(getattr(sink, "scale_encodings", None) or {}, site_widths)


def sink_margin_sites(sink: Any, site_widths: Mapping[str, int]) -> dict[str, Any]:
    """{site: tracestore Site} of the recorded sites that ``sink``'s store declares with hint encoding ``margin``
    (a tracestore ``Writer``'s store, or a sink's own ``margin_sites`` such as `MemorySink`'s; none for other
    sinks)."""
    own = getattr(sink, "margin_sites", None)
    if isinstance(own, Mapping):
        return {s: own[s] for s in site_widths if s in own}
    store = getattr(sink, "store", None)
    sites = getattr(store, "sites", None)
    if not isinstance(sites, Mapping):
        return {}
    return {s: sites[s] for s in site_widths if s in sites and getattr(sites[s], "hint_encoding", "bits") == "margin"}


class MemorySink:
    """In-memory `TraceSink` with a reader: ``read(traj_id, start, stop, sites=, features=)``; ``scale_encodings``:
    {site: "bytes" | "lsb"} (default bytes), the scale rows it expects as a store of that declaration does;
    ``margin_sites``: {site: tracestore Site of hint encoding margin, e.g. `tracerl.hints.compact.store_site`}, the
    sites it keeps as margin-exception rows (``rows`` of `write` and of `TracePiece`), as such a store does.

    Raises `RecorderError` for an unknown encoding or a margin site that is not recorded or not of encoding margin."""

    def __init__(self, site_widths: Mapping[str, int], block_size: int = NVFP4_BLOCK_SIZE, *,
                 scale_encodings: Mapping[str, str] | None = None, margin_sites: Mapping[str, Any] | None = None):
        self.site_widths = dict(site_widths)
        self.block_size = block_size
        self.scale_encodings = _check_encodings(scale_encodings or {}, self.site_widths)
        self.margin_sites = dict(margin_sites or {})
        bad = [s for s, site in self.margin_sites.items()
               if s not in self.site_widths or getattr(site, "hint_encoding", "bits") != "margin"]
        if bad:
            raise RecorderError(f"margin sites {bad[:4]}: each must be a recorded site declared with hint encoding "
                                f"margin (tracerl.hints.compact.store_site)")
        self._pieces: dict[str, list[tuple[int, TracePiece]]] = {}

    def write(self, traj_id, token_start, *, hints, scales, token_ids, logprobs, experts=None, policy_version=0,
              rows=None):
        rows = dict(rows or {})
        missing = sorted((set(self.site_widths) - set(self.margin_sites) - set(hints))
                         | (set(self.margin_sites) - set(rows)))
        if missing:
            raise RecorderError(f"write for {traj_id!r} lacks sites {missing[:4]}")
        n = len(token_ids)
        piece = TracePiece(
            hints={k: np.asarray(v) for k, v in hints.items()},
            scales={k: np.asarray(v) for k, v in scales.items()},
            token_ids=np.asarray(token_ids),
            logprobs=np.asarray(logprobs, dtype=np.float32),
            experts={k: np.asarray(v) for k, v in (experts or {}).items()},
            policy_version=np.full(n, policy_version, dtype=np.int64),
            positions=np.arange(token_start, token_start + n, dtype=np.int64),
            rows={s: (np.asarray(d), np.asarray(o)) for s, (d, o) in rows.items()},
        )
        self._pieces.setdefault(traj_id, []).append((token_start, piece))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def trajectories(self) -> list[str]:
        return sorted(self._pieces)

    def num_tokens(self, traj_id: str) -> int:
        return max(s + len(p.token_ids) for s, p in self._pieces[traj_id])

    def read(self, traj_id, start=0, stop=None, *, sites=None, features=None) -> TracePiece:
        pieces = sorted(self._pieces[traj_id], key=lambda t: t[0])
        stop = self.num_tokens(traj_id) if stop is None else stop
        sites = list(self.site_widths) if sites is None else list(sites)

        def cat(get):
            return np.concatenate([get(p) for _, p in pieces])[start:stop]

        def feat(arr, per):
            if features is None:
                return arr
            lo, hi = features
            return arr[:, lo // per : -(-hi // per)]

        def per_scale(s: str) -> int:  # values one stored scale byte covers
            return self.block_size * (HINTS_PER_BYTE if self.scale_encodings[s] == "lsb" else 1)

        def rows_of(s: str) -> tuple[np.ndarray, np.ndarray]:  # the pieces' rows joined, then [start, stop)
            data, ends = [], [np.zeros(1, np.int64)]
            for _, p in pieces:
                d, o = p.rows[s]
                ends.append(np.asarray(o[1:], np.int64) + ends[-1][-1])
                data.append(d)
            off = np.concatenate(ends)[start:stop + 1]
            return np.concatenate(data)[off[0]:off[-1]], off - off[0]

        plain = [s for s in sites if s not in self.margin_sites]
        return TracePiece(
            hints={s: feat(cat(lambda p, s=s: p.hints[s]), HINTS_PER_BYTE) for s in plain},
            scales={s: feat(cat(lambda p, s=s: p.scales[s]), per_scale(s)) for s in plain},
            token_ids=cat(lambda p: p.token_ids),
            logprobs=cat(lambda p: p.logprobs),
            experts={k: cat(lambda p, k=k: p.experts[k]) for k in pieces[0][1].experts},
            policy_version=cat(lambda p: p.policy_version),
            positions=cat(lambda p: p.positions),
            rows={s: rows_of(s) for s in sites if s in self.margin_sites},
        )


@dataclasses.dataclass
class _Field:
    """Host arena of one field: [slots, cap, *row] values and [slots, cap] filled flags."""

    arrays: list[np.ndarray]
    fill: tuple  # fill value per array
    filled: np.ndarray


class RolloutRecorder:
    """Buffers per-step captures per request (bounded) and writes complete token ranges to a `TraceSink`.

    Parameters
    ----------
    sink: the store writer (or `MemorySink`).
    site_widths: {site: width} of the hinted sites; every write carries all of them.
    moe_layers, top_k: routed-expert records (uint8 [T, top_k] per layer name); ``()`` for none.
    flush_tokens: a request's complete leading rows are written once at least this many are buffered.
    drain_every: steps between device-to-host drains of the staged payloads.
    block_size: the FP4 block (16 for NVFP4); a site's scale row has width / block_size bytes, or with scale
        encoding lsb ceil(width / block_size / 8).
    scale_encodings: {site: "bytes" | "lsb"} (module docstring); default: the sink's (`sink_scale_encodings`).
    margin_pack: where margin-site rows are packed when written (`MARGIN_PACKS`): "auto" on the marks' device when
        it is a CUDA device, else on the host; "device" on the marks' device (CPU too); "host" always on the host
        (numpy). The bytes are the same.

    Raises `RecorderError` for bad sizes, an unknown scale encoding or an unknown ``margin_pack``.
    """

    def __init__(
        self,
        sink: TraceSink,
        site_widths: Mapping[str, int],
        *,
        moe_layers: Sequence[str] = (),
        top_k: int = 0,
        flush_tokens: int = 2048,
        drain_every: int = 32,
        block_size: int = NVFP4_BLOCK_SIZE,
        scale_encodings: Mapping[str, str] | None = None,
        margin_pack: str = "auto",
    ):
        if flush_tokens < 1 or drain_every < 1:
            raise RecorderError(f"flush_tokens={flush_tokens} and drain_every={drain_every} must be >= 1")
        if margin_pack not in MARGIN_PACKS:
            raise RecorderError(f"margin_pack must be one of {list(MARGIN_PACKS)}; got {margin_pack!r}")
        self.margin_pack = margin_pack
        #: margin site -> the device its marks were computed on (where "auto" / "device" pack its rows)
        self._margin_devices: dict[str, torch.device] = {}
        self.sink = sink
        self.site_widths = dict(site_widths)
        self.moe_layers = list(moe_layers)
        self.top_k = top_k
        self.flush_tokens = flush_tokens
        self.drain_every = drain_every
        self.block_size = block_size
        self.scale_encodings = (sink_scale_encodings(sink, self.site_widths) if scale_encodings is None else
                                _check_encodings(scale_encodings, self.site_widths))
        #: site -> tracestore Site of the sites recorded as margin-exception rows (module docstring)
        self.margin_sites = sink_margin_sites(sink, self.site_widths)
        self._cap = 2 * flush_tokens
        self._slots: dict[str, int] = {}
        self._slot_rid: dict[int, str] = {}
        self._gen = 0  # bumped whenever the request -> slot map changes
        self._last_ids: tuple = (None, -1, None)
        self._free: list[int] = []
        self._nslots = 0
        self._start = np.zeros(0, dtype=np.int64)  # first unwritten position per slot
        self._hi = np.zeros(0, dtype=np.int64)  # one past the highest position received per slot
        self._policy: dict[str, int] = {}
        self._fields: dict[Any, _Field] = {}
        self._staged: list[tuple[Any, np.ndarray, np.ndarray, tuple[torch.Tensor, ...]]] = []
        self._inflight: list[tuple[Any, list, list]] = []
        self._steps = 0
        self.tokens_written = 0
        self.bytes_written = 0
        for s, w in self.site_widths.items():
            nscale = scale_lsb_bytes(w // block_size) if self.scale_encodings[s] == "lsb" else w // block_size
            specs = [(w // HINTS_PER_BYTE, np.uint8, 0), (nscale, np.uint8, 0)]
            if s in self.margin_sites:  # + value marks [W/8] and block marks [ceil(W/128)] (packed, 0: unmarked)
                specs += [(w // HINTS_PER_BYTE, np.uint8, 0), (scale_lsb_bytes(w // block_size), np.uint8, 0)]
            self._add_field(("site", s), specs)
        for layer in self.moe_layers:
            self._add_field(("experts", layer), [(top_k, np.uint8, NO_EXPERT)])
        self._add_field("tokens", [((), np.int64, -1), ((), np.float32, np.nan)])

    # ---- arena ------------------------------------------------------------------------------------------
    def _add_field(self, key, specs) -> None:
        arrays = [np.full((0, self._cap, *((w,) if w != () else ())), f, dtype=dt) for w, dt, f in specs]
        self._fields[key] = _Field(arrays, tuple(f for _, _, f in specs), np.zeros((0, self._cap), dtype=bool))

    def _grow_slots(self) -> None:
        new = max(4, 2 * self._nslots)
        extra = new - self._nslots
        for fld in self._fields.values():
            fld.arrays = [
                np.concatenate([a, np.full((extra, *a.shape[1:]), f, dtype=a.dtype)])
                for a, f in zip(fld.arrays, fld.fill)
            ]
            fld.filled = np.concatenate([fld.filled, np.zeros((extra, self._cap), dtype=bool)])
        self._start = np.concatenate([self._start, np.zeros(extra, dtype=np.int64)])
        self._hi = np.concatenate([self._hi, np.zeros(extra, dtype=np.int64)])
        self._free.extend(range(new - 1, self._nslots - 1, -1))
        self._nslots = new

    def _grow_cap(self) -> None:
        extra = self._cap
        for fld in self._fields.values():
            fld.arrays = [
                np.concatenate([a, np.full((a.shape[0], extra, *a.shape[2:]), f, dtype=a.dtype)], axis=1)
                for a, f in zip(fld.arrays, fld.fill)
            ]
            fld.filled = np.concatenate([fld.filled, np.zeros((self._nslots, extra), dtype=bool)], axis=1)
        self._cap += extra

    # ---- engine interface -------------------------------------------------------------------------------
    def begin(self, request_id: str, policy_version: int = 0) -> None:
        if request_id in self._slots:
            raise RecorderError(f"request {request_id!r} was already begun and not ended")
        if not self._free:
            self._grow_slots()
        slot = self._free.pop()
        self._slots[request_id] = slot
        self._slot_rid[slot] = request_id
        self._gen += 1
        self._start[slot] = 0
        self._hi[slot] = 0
        self._policy[request_id] = int(policy_version)

    def _slot_index(self, request_ids: Sequence[str]) -> np.ndarray:
        # Engines pass the same request-id list for every site of a step: map it to slots once.
        if request_ids is self._last_ids[0] and self._last_ids[1] == self._gen:
            return self._last_ids[2]
        try:
            slots = np.fromiter((self._slots[r] for r in request_ids), dtype=np.int64, count=len(request_ids))
        except KeyError as e:
            raise RecorderError(f"request {e.args[0]!r} was not begun (call begin() first)") from None
        self._last_ids = (request_ids, self._gen, slots)
        return slots

    def _stage(self, key, request_ids, positions, *payload: torch.Tensor) -> None:
        slots = self._slot_index(request_ids)
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        if pos.shape[0] != slots.shape[0] or any(p.shape[0] != slots.shape[0] for p in payload):
            raise RecorderError(
                f"{key}: {len(slots)} request ids, {pos.shape[0]} positions, payload rows "
                f"{[p.shape[0] for p in payload]} must all match"
            )
        self._staged.append((key, slots, pos, tuple(torch.as_tensor(p).detach() for p in payload)))

    def record_sites(self, request_ids, positions, site: str, hints, scales, *, x=None, global_scale=None,
                     marks=None) -> None:
        """Hint bits uint8 [N, width/8] and block scales uint8 [N, width/block] (the quantizer's E4M3 bytes) of
        ``site`` for N tokens; at a site of scale encoding lsb the scales are packed to their LSBs here, on their
        device. At a margin site (module docstring) also the activation ``x`` [N, width] (bf16/fp16/fp32) that was
        quantized and its ``global_scale`` (fp32 0-d tensor or float): the marks are computed here, on x's device;
        or, instead, ``marks``: (value marks uint8 [N, width/8], block marks uint8 [N, ceil(width/128)]) that
        ``tracefp4.margin_marks`` gave for them at the site's margins (a static/graph decode computes them in its
        step). Elsewhere ``x`` and ``marks`` are not used. Raises `RecorderError` for an unknown site, scales of
        another width, a margin site without ``x`` or ``marks``, or marks of another shape."""
        if site not in self.site_widths:
            raise RecorderError(f"site {site!r} is not recorded; recorded sites: {sorted(self.site_widths)[:4]}...")
        msite = self.margin_sites.get(site)
        if msite is not None:
            hints, scales = torch.as_tensor(hints), torch.as_tensor(scales)
            if marks is not None:
                value_marks, block_marks = (torch.as_tensor(m) for m in marks)
                w, n = self.site_widths[site], hints.shape[0]
                want = ((n, w // 8), (n, -(-w // 128)))
                if ((tuple(value_marks.shape), tuple(block_marks.shape)) != want or value_marks.dtype != torch.uint8
                        or block_marks.dtype != torch.uint8):
                    raise RecorderError(f"site {site!r}: marks {tuple(value_marks.shape)} {value_marks.dtype} and "
                                        f"{tuple(block_marks.shape)} {block_marks.dtype}; expected uint8 {want[0]} "
                                        f"and {want[1]}")
            elif x is None or global_scale is None:
                raise RecorderError(f"site {site!r} is stored as margin-exception rows (hint encoding margin): "
                                    f"record_sites needs its activation x [N, {self.site_widths[site]}] and "
                                    f"global_scale (RolloutEngine(margin_capture=True))")
            else:
                value_marks, block_marks = tracefp4.margin_marks(x, global_scale, scales, hints, msite.margin,
                                                                 msite.scale_margin, backend="auto")
            self._margin_devices[site] = value_marks.device
            self._stage(("site", site), request_ids, positions, hints, scales, value_marks, block_marks)
            return
        if self.scale_encodings[site] == "lsb":
            scales = torch.as_tensor(scales)
            blocks = self.site_widths[site] // self.block_size
            if scales.dim() != 2 or scales.shape[1] != blocks:
                raise RecorderError(f"site {site!r}: scales {tuple(scales.shape)}; expected the E4M3 bytes [N, "
                                    f"{blocks}] (the recorder packs their LSBs: the store keeps scale hints)")
            scales = pack_scale_lsb(scales.view(torch.uint8) if scales.element_size() == 1 else scales)
        self._stage(("site", site), request_ids, positions, hints, scales)

    def record_experts(self, request_ids, positions, layer: str, expert_ids) -> None:
        """Routed expert ids [N, top_k] (any int dtype; stored as uint8) of MoE layer ``layer``."""
        if ("experts", layer) not in self._fields:
            raise RecorderError(f"MoE layer {layer!r} is not recorded; recorded layers: {self.moe_layers[:4]}...")
        self._stage(("experts", layer), request_ids, positions, expert_ids)

    def record_tokens(self, request_ids, positions, token_ids, logprobs) -> None:
        """Token ids [N] at ``positions`` and their sampling log-probs [N] (NaN for prompt tokens)."""
        self._stage("tokens", request_ids, positions, token_ids, logprobs)

    def step(self) -> None:
        """End of one forward step; every ``drain_every`` steps starts the device-to-host copy."""
        self._steps += 1
        if self._steps % self.drain_every == 0:
            self._drain()
        self._poll(block=False)

    def end(self, request_id: str) -> None:
        """The request is finished: write all its buffered rows and free its slot."""
        self._drain()
        self._poll(block=True)
        slot = self._slots.get(request_id)
        if slot is None:
            raise RecorderError(f"request {request_id!r} was not begun")
        self._write(request_id, slot, int(self._hi[slot] - self._start[slot]), final=True)
        del self._slots[request_id]
        del self._slot_rid[slot]
        self._free.append(slot)
        self._gen += 1

    def end_all(self) -> None:
        for rid in list(self._slots):
            self.end(rid)

    def close(self) -> None:
        self.end_all()
        self.sink.flush()

    # ---- transfer -------------------------------------------------------------------------------------
    def _drain(self) -> None:
        if not self._staged:
            return
        # One group per field and payload device: prompt rows come from the host while decode rows live on the
        # device; host rows stay on the host (a pageable host -> device copy would block).
        groups: dict[Any, list] = {}
        for key, slots, pos, payload in self._staged:
            dev = next((p.device for p in payload if p.device.type != "cpu"), None)
            groups.setdefault((key, dev), []).append((slots, pos, payload))
        self._staged = []
        for (key, dev), items in groups.items():
            host = []
            event = None
            for j in range(len(items[0][2])):
                parts = [it[2][j].reshape(it[2][j].shape[0], -1) for it in items]
                if dev is None:
                    host.append(torch.cat(parts))
                    continue
                # (a host tensor staged together with device ones in one record_* call goes along)
                cat = torch.cat([t.to(dev, non_blocking=True) for t in parts])
                if dev.type == "cuda":
                    buf = torch.empty(cat.shape, dtype=cat.dtype, pin_memory=True)
                    buf.copy_(cat, non_blocking=True)
                    host.append(buf)
                else:
                    host.append(cat.cpu())
            if dev is not None and dev.type == "cuda":
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(dev))
            slots = np.concatenate([it[0] for it in items])
            pos = np.concatenate([it[1] for it in items])
            self._inflight.append((key, (slots, pos, host), event))

    def _poll(self, *, block: bool) -> None:
        # In drain order: once one copy is still in flight, later ones wait too (rows land in the order staged).
        keep = []
        for key, data, event in self._inflight:
            if keep or (event is not None and not event.query()):
                if not block:
                    keep.append((key, data, event))
                    continue
                if event is not None:
                    event.synchronize()
            self._materialize(key, *data)
        self._inflight = keep

    def _materialize(self, key, slots: np.ndarray, pos: np.ndarray, host: list[torch.Tensor]) -> None:
        off = pos - self._start[slots]
        if (off < 0).any():
            raise RecorderError(f"{key}: positions before the already-written range of their request")
        while off.max(initial=0) >= self._cap:
            touched = np.unique(slots[off >= self._cap])
            for s in touched:
                self._flush_complete(int(s))
            off = pos - self._start[slots]
            if off.max(initial=0) >= self._cap:
                self._grow_cap()
        fld = self._fields[key]
        for arr, h in zip(fld.arrays, host):
            vals = h.numpy().astype(arr.dtype, copy=False)
            arr[slots, off] = vals.reshape(len(slots), *arr.shape[2:])
        fld.filled[slots, off] = True
        np.maximum.at(self._hi, slots, pos + 1)
        for s in np.unique(slots):
            if self._hi[s] - self._start[s] >= self.flush_tokens:
                self._flush_complete(int(s))

    # ---- writes ---------------------------------------------------------------------------------------
    def _margin_rows(self, staged: Mapping[str, tuple[np.ndarray, ...]]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """The margin-exception rows (data uint8 [n], offsets int64 [T + 1]) of T recorded rows of each site of
        ``staged`` (site -> its staged (hints, scales, value marks, block marks)), in that order, packed on the host
        or on the marks' device (``margin_pack``); on a device, the sites that share a coding are packed in one
        call (`compact_device.pack_sites_on_device`: one sync and one copy back per such group, not per site)."""
        on_device: dict[torch.device, dict[str, compact_device.SiteMarks]] = {}
        out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for site, (hints, scales, value_marks, block_marks) in staged.items():
            ms = self.margin_sites[site]
            coding = compact.SiteCoding(ms.value_coding, ms.block_coding)
            dev = self._margin_devices.get(site, torch.device("cpu"))
            if self.margin_pack == "device" or (self.margin_pack == "auto" and dev.type == "cuda"):
                on_device.setdefault(dev, {})[site] = (value_marks, block_marks, hints, scales, coding,
                                                       ms.scale_payload)
                continue
            enc = compact.exceptions_from_marks(torch.from_numpy(value_marks), torch.from_numpy(block_marks),
                                                torch.from_numpy(hints), torch.from_numpy(scales), ms.margin,
                                                ms.scale_margin, ms.scale_payload)
            out[site] = compact.store_rows(compact.pack_rows(enc, coding))
        for dev, sites in on_device.items():
            out.update(compact_device.pack_sites_on_device(dev, sites))
        return {s: out[s] for s in staged}

    def _complete_rows(self, slot: int) -> int:
        n = int(self._hi[slot] - self._start[slot])
        ok = np.ones(n, dtype=bool)
        for fld in self._fields.values():
            ok &= fld.filled[slot, :n]
        bad = np.flatnonzero(~ok)
        return int(bad[0]) if bad.size else n

    def _flush_complete(self, slot: int) -> None:
        rid = self._slot_rid[slot]
        n = self._complete_rows(slot)
        if n >= self.flush_tokens or n >= self._cap // 2:
            self._write(rid, slot, n, final=False)

    def _write(self, rid: str, slot: int, n: int, *, final: bool) -> None:
        if n > 0:
            tok = self._fields["tokens"]
            if not tok.filled[slot, :n].all():
                raise RecorderError(f"request {rid!r}: token ids missing at offsets "
                                    f"{np.flatnonzero(~tok.filled[slot, :n])[:8].tolist()}")
            hints, scales, staged = {}, {}, {}
            for s in self.site_widths:
                arrays = self._fields[("site", s)].arrays
                if s in self.margin_sites:
                    staged[s] = tuple(a[slot, :n] for a in arrays)
                    continue
                h, sc = arrays
                hints[s], scales[s] = h[slot, :n].copy(), sc[slot, :n].copy()
            rows = self._margin_rows(staged) if staged else {}
            experts = {la: self._fields[("experts", la)].arrays[0][slot, :n].copy() for la in self.moe_layers}
            self.sink.write(
                rid,
                int(self._start[slot]),
                hints=hints,
                scales=scales,
                token_ids=tok.arrays[0][slot, :n].copy(),
                logprobs=tok.arrays[1][slot, :n].copy(),
                experts=experts or None,
                policy_version=self._policy[rid],
                **({"rows": rows} if rows else {}),
            )
            self.tokens_written += n
            self.bytes_written += (sum(v.nbytes for v in hints.values()) + sum(v.nbytes for v in scales.values())
                                   + sum(d.nbytes for d, _ in rows.values()))
        # Shift the slot's remaining rows to the front and reset the tail.
        keep = 0 if final else int(self._hi[slot] - self._start[slot]) - n
        for fld in self._fields.values():
            for a, f in zip(fld.arrays, fld.fill):
                if keep:
                    a[slot, :keep] = a[slot, n : n + keep]
                a[slot, keep:] = f
            if keep:
                fld.filled[slot, :keep] = fld.filled[slot, n : n + keep]
            fld.filled[slot, keep:] = False
        self._start[slot] += n
        if final:
            self._hi[slot] = self._start[slot]
