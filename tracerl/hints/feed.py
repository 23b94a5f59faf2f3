"""The hint feed: what a trainer's forward needs from a trace store, per micro-batch of the trainer's own packing.

A trainer hands the feed its packing of a step — a list of micro-batches, each a list of ``(traj_id, start, stop)``
token ranges concatenated in THD layout — and iterates; for each micro-batch the feed yields a `FeedBatch` of
device tensors for this rank's slice:

- data parallel ``dp=(rank, size)``: rank r takes micro-batches r, r+size, ... (leave it None when the trainer
  already hands each rank its own micro-batches);
- context parallel ``cp=(rank, size)``: each sequence's zig-zag chunks of this rank (`cp_zigzag_ranges`);
- tensor parallel ``tp=(rank, size)``: each site's block-aligned slice of features (`tp_feature_range`).

Reading runs ahead in a background thread, in the order the trainer consumes the batches, while the batches read
and not yet consumed hold at most ``read_ahead_bytes`` (at least one is always read); on a CUDA device that thread
only waits for a reader process (``reader="process"``, the default there: `ReaderProcess`), which does the reading,
so that no reading Python competes with the trainer's for the GIL. The copy to the device happens when a batch is
handed out, from pinned memory without a host sync. Errors of the reading thread are raised where
the trainer would have received the batch. A feed reads trajectories through a `tracestore.Reader` of the newest
snapshot (refreshed once when a trajectory is not in it yet), or through the committed records the caller already
holds (``trajectories=``: our follower's `Trajectory` objects), which needs no log index at all.

The feed imports nothing of tracerl's own trainer: `tracerl.hints.patch_model` is the other half, which installs
the hint-guided quantization in the trainer's model and takes a `FeedBatch`'s tensors in its forward.

**Margin sites.** A site the store keeps as margin-exception rows (hint encoding margin, tracestore format 5) has no
``hints``/``scales`` entry: its rows are decoded into ``FeedBatch.margin[site]`` (`compact.DenseExceptions` from the
Triton decoder, else `compact.MarginExceptions`, on the device), and the forward works out the scales and hints from
its own activation with `FeedBatch.reconstruct` (`compact.reconstruct`), then rounds with today's hint-guided
kernels. Where they are decoded is ``margin_decode``: on a CUDA feed device (``"auto"``, the default: the Triton
decoder `compact_triton.unpack_sites_dense`; ``"triton"`` names it; ``"device"``, on any device, the torch codec
`compact_device.unpack_sites_torch`) the reading thread hands over the raw rows and they are decoded on the device
when the batch is handed out (on a side stream: the syncs wait for the decode's own kernels, not for the trainer's
queued work; the sites that share a width, coding and scale payload are decoded in one call, so a micro-batch
costs the syncs of one decode per such group, not per site); otherwise (``"host"``, or ``"auto"`` on the CPU) the
reading thread decodes them with numpy (`compact.unpack_rows`) and the masks and bytes are copied over. All give
equal exceptions. Such a site is read whole (no tensor-parallel feature slice).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

import tracestore as ts
from tracerl.artifacts.codes import RolloutCodes
from tracerl.config import MARGIN_DECODES
from tracerl.errors import ConfigError
from tracerl.hints import compact
from tracerl.hints.compact_device import resolve_margin_decode, unpack_sites
from tracerl.hints.packing import MicroBatch, PackedHints, Segment, cp_shard, dp_shard, read_packed, tp_feature_range
from tracerl.hints.source import ReaderProcess, RecordSource, SnapshotSource, packed_nbytes
from tracerl.util import to_device

#: `HintFeed`'s ``reader`` choices
READERS = ("auto", "thread", "process")

__all__ = ["FeedBatch", "HintFeed", "MARGIN_DECODES"]


@dataclasses.dataclass
class FeedBatch:
    """One micro-batch as this rank's forward needs it, on the feed's device (THD: T tokens of S segments).

    ``hints``/``scales`` are the rollout's, row for row with ``token_ids``, for this rank's features of each site;
    the forward of a patched model (`tracerl.hints.patch_model`) takes them directly."""

    segments: tuple[Segment, ...]  # this rank's token ranges (after context-parallel slicing)
    cu_seqlens: torch.Tensor  # int32 [S+1], the varlen-attention convention
    max_seqlen: int
    token_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T], each token's position in its trajectory (rotary phase)
    logprobs: torch.Tensor  # float32 [T], the rollout's log-probs (NaN for prompt tokens)
    policy_versions: torch.Tensor  # int64 [T], the policy version that generated each token
    hints: dict[str, torch.Tensor]  # site -> uint8 [T, w/8] (w: this rank's features of the site)
    # site -> uint8 [T, w/16] (E4M3 block scales), or at a site of scale encoding lsb [T, ceil(w/128)] (scale hints:
    # the trainer's forward reconstructs the bytes, `tracerl.hints.scalehints`)
    scales: dict[str, torch.Tensor]
    global_scales: dict[str, torch.Tensor]  # site -> fp32 0-d: the g the rollout divided by
    experts: dict[str, torch.Tensor]  # MoE layer -> uint8 [T, top_k], the rollout's routed experts (ascending)
    rewards: torch.Tensor  # float32 [S], each segment's trajectory reward (NaN without a committed result)
    features: dict[str, tuple[int, int]]  # site -> this rank's feature slice [lo, hi)
    host: PackedHints = dataclasses.field(repr=False)  # the same data as host (numpy) arrays
    #: with ``codes=True``: site -> uint8 [T, W/2], the rollout's recorded packed E2M1 codes (`tracerl.artifacts
    #: .codes`; whole rows, sites and trajectories that have them), the reference of code agreement
    codes: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    #: site -> the store's scale encoding ("bytes" | "lsb"): what ``scales`` rows hold
    scale_encodings: dict[str, str] = dataclasses.field(default_factory=dict)
    #: margin sites (module docstring): site -> the rollout's exceptions at these T rows, on the device:
    #: `compact.DenseExceptions` from the Triton decoder ("auto" on CUDA, "triton"), else `compact.MarginExceptions`
    margin: dict[str, compact.MarginExceptions | compact.DenseExceptions] = dataclasses.field(default_factory=dict)
    loaded_unix: float = 0.0  # when its reading finished (lag measurements)
    read_s: float = 0.0  # seconds its reading took

    def reconstruct(self, site: str, x: torch.Tensor, *, backend: str = "auto") -> compact.Reconstruction:
        """The scales (uint8 [T, W/16]) and hints (uint8 [T, W/8]) the forward rounds margin site ``site``'s
        activation ``x`` [T, W] with (`compact.reconstruct` with the rollout's global scale). Raises `ConfigError`
        for a site that is not a margin site of this batch or has no global scale, and as `compact.reconstruct`."""
        if site not in self.margin:
            raise ConfigError(f"site {site!r} is not a margin site of this batch (margin sites: {list(self.margin)})")
        if site not in self.global_scales:
            raise ConfigError(f"site {site!r}: no global scale to reconstruct with (the feed's global_scales)")
        return compact.reconstruct(self.margin[site], x, self.global_scales[site], backend=backend)

    @property
    def response(self) -> torch.Tensor:
        """bool [T]: the tokens the rollout generated (a log-prob recorded), i.e. what a policy loss sees."""
        return ~torch.isnan(self.logprobs)


def _reward(result: ts.Result | None) -> float:
    return float("nan") if result is None else float(result.reward)


@dataclasses.dataclass(frozen=True)
class _HasResult:
    """What `tracerl.artifacts.codes.RolloutCodes.get` looks a trajectory's result up on."""

    result: ts.Result | None


def _micro_batch(mb: MicroBatch | Iterable[tuple[str, int, int]]) -> MicroBatch:
    if isinstance(mb, MicroBatch):
        return mb
    try:
        return MicroBatch(tuple(s if isinstance(s, Segment) else Segment(str(s[0]), int(s[1]), int(s[2])) for s in mb))
    except (TypeError, IndexError, ValueError) as e:
        raise ConfigError(f"a micro-batch is a MicroBatch or a sequence of (traj_id, start, stop); got {mb!r:.120}"
                          f" ({e})") from None


def _rank(name: str, value: tuple[int, int] | None) -> tuple[int, int] | None:
    if value is None:
        return None
    rank, size = value
    if not (isinstance(rank, int) and isinstance(size, int) and size >= 1 and 0 <= rank < size):
        raise ConfigError(f"{name}=({rank!r}, {size!r}): need (rank, size) with size >= 1 and 0 <= rank < size")
    return rank, size


class HintFeed:
    """Per-micro-batch device tensors of a store's hints, scales, routes and rollout trace (see the module docs).

    Args:
        store: an open `tracestore.Store`.
        sites: the sites to read (default: every site the store declares).
        device: where the tensors go (the trainer's device).
        dp, cp, tp: this rank's (rank, size) of data, context and tensor parallelism (None: not split that way).
        read_ahead_bytes: the most host memory the batches read ahead may hold.
        global_scales: site -> g the rollout divided by (default: the store's model metadata ``global_scales``;
            a store written by SGLang records them per policy version: `tracerl.sglang`).
        codes: also hand out the rollout's recorded codes (``FeedBatch.codes``), where it recorded them.
        margin_decode: where margin sites' rows are decoded (`MARGIN_DECODES`, module docstring): "auto" on a
            CUDA device by the Triton decoder (`compact_device.resolve_margin_decode`), else on the host; "device" on
            the device by the torch codec (CPU too); "host" on the host; "triton" on the device by
            `compact_triton.unpack_sites_dense` (with it, and with "auto" on CUDA, ``FeedBatch.margin`` holds
            `compact.DenseExceptions`).
        reader: where the batches are read ahead: "thread" (a daemon thread of this process), "process" (a
            `ReaderProcess` child, started at the first `iterate` and ended by `close`: no reading Python competes
            with the caller's for the GIL, which a host-bound trainer launching GPU kernels feels: a reading thread
            slowed an H200 step from 0.36 to 0.54 s, trainer-h200-read-next.json), or "auto" (the default: a process
            on a CUDA device when the store can be opened in another process, else a thread).

    Raises `ConfigError` for unknown sites, bad ranks, sites whose width does not split into ``tp`` slices, an
    unknown ``margin_decode`` or ``reader``, or ``reader="process"`` for a store another process cannot open
    (``memory://``).
    """

    def __init__(self, store: ts.Store, *, sites: Sequence[str] | None = None, device: str | torch.device = "cpu",
                 dp: tuple[int, int] | None = None, cp: tuple[int, int] | None = None,
                 tp: tuple[int, int] | None = None, read_ahead_bytes: int = 256 << 20,
                 global_scales: Mapping[str, float] | None = None, codes: bool = False,
                 margin_decode: str = "auto", reader: str = "auto"):
        if margin_decode not in MARGIN_DECODES:
            raise ConfigError(f"margin_decode must be one of {list(MARGIN_DECODES)}; got {margin_decode!r}")
        if reader not in READERS:
            raise ConfigError(f"reader must be one of {list(READERS)}; got {reader!r}")
        self.store = store
        self.sites = list(store.sites) if sites is None else list(sites)
        unknown = [s for s in self.sites if s not in store.sites]
        if unknown:
            raise ConfigError(f"sites {unknown[:4]} are not declared by {store.url} (it declares "
                              f"{list(store.sites)[:6]})")
        self.device = torch.device(device)
        #: the margin decoder on this device ("auto" resolved: `compact_device.resolve_margin_decode`)
        self.margin_decode = resolve_margin_decode(margin_decode, self.device)
        #: decode margin rows on the device (when a batch is handed out) rather than in the reading thread
        self.margin_on_device = self.margin_decode != "host"
        self.dp, self.cp, self.tp = _rank("dp", dp), _rank("cp", cp), _rank("tp", tp)
        self.margin_sites = [s for s in self.sites if getattr(store.sites[s], "hint_encoding", "bits") == "margin"]
        if self.margin_sites and self.tp is not None:
            raise ConfigError(f"sites {self.margin_sites[:4]} store margin-exception rows, which are read whole: no "
                              f"tensor-parallel slice (tp={tp}); read them without tp, or declare one site per slice")
        # a tensor-parallel slice starts at a scale byte: a block of 16, or 8 blocks at a scale-hint site
        self.features = {s: (tp_feature_range(store.sites[s].width, *self.tp,
                                              block=store.sites[s].scale_values_per_byte) if self.tp else
                             (0, store.sites[s].width)) for s in self.sites}
        # the sites read together: by feature slice under tp, else all of them whole (features None)
        self._groups: dict[tuple[int, int] | None, list[str]] = {}
        for s in self.sites:
            self._groups.setdefault(self.features[s] if self.tp else None, []).append(s)
        self.scale_encodings = {s: store.sites[s].scale_encoding for s in self.sites if s not in self.margin_sites}
        self.read_ahead_bytes = int(read_ahead_bytes)
        scales = dict(global_scales if global_scales is not None else (store.model.get("global_scales") or {}))
        self.global_scales = {s: torch.tensor(float(scales[s]), dtype=torch.float32) for s in self.sites if s in scales}
        self._reader: SnapshotSource | None = None
        self._codes = RolloutCodes(store) if codes else None
        try:
            store.open_args()
            reopenable = True
        except ts.LocationError:
            reopenable = False
        if reader == "process" and not reopenable:
            raise ConfigError(f"reader='process': the store {store.url} cannot be opened in another process; use "
                              "reader='thread'")
        #: where batches are read ahead ("auto" resolved): "thread" or "process"
        self.reader = reader if reader != "auto" else ("process" if self.device.type == "cuda" and reopenable
                                                       else "thread")
        self._process: ReaderProcess | None = None

    # ---- reading ---------------------------------------------------------------------------------------
    def _read(self, mb: MicroBatch, source: Any, trajectories: Mapping[str, Any] | None = None) -> PackedHints:
        """``mb``'s rows of every site, one read per group of sites of one feature slice (all sites whole without
        tp; one ranged read per segment): here from ``source``, or by the reader process (the thread waits without
        the GIL and copies the arrays out of shared memory with numpy copies, which release it)."""
        groups = self._groups or {None: []}
        if self._process is None:
            parts = [read_packed(source, mb, sites, features=f, read_kwargs={"fmt": "numpy"})
                     for f, sites in groups.items()]
        else:
            futures = [self._process.submit(trajectories, [mb], sites, 0, features=f) for f, sites in groups.items()]
            parts = [ReaderProcess.take_result(fut)[0][0] for fut in futures]
        first = parts[0]
        for p in parts[1:]:
            first.hints.update(p.hints)
            first.scales.update(p.scales)
            first.margin.update(p.margin)
        return first

    def _decode_margin(self, packed: PackedHints) -> dict[str, compact.MarginExceptions] | None:
        """The margin sites' rows of ``packed`` decoded (host tensors), on the reading thread; None when they are
        decoded on the device instead (`_on_device`)."""
        if self.margin_on_device:
            return None
        return {s: compact.unpack_rows(compact.packed_from_store(self.store.sites[s], rows))
                for s, rows in packed.margin.items()}

    def _recorded_codes(self, packed: PackedHints, result) -> dict[str, np.ndarray]:
        """The rollout's codes of ``packed``'s rows per site, for the sites every segment has them at."""
        out = {}
        for site in self.sites:
            parts = []
            for seg in packed.segments:
                full = self._codes.get(_HasResult(result(seg.traj_id)), site)
                if full is None:
                    break
                parts.append(full[seg.start:seg.stop])
            else:
                if parts:
                    out[site] = np.concatenate(parts)
        return out

    def _producer(self, mbs: list[MicroBatch], source: Any, result, out: _Queue,
                  trajectories: Mapping[str, Any] | None = None) -> None:
        try:
            for mb in mbs:
                t0 = time.perf_counter()
                packed = self._read(mb, source, trajectories)
                margin = self._decode_margin(packed)
                codes = {} if self._codes is None else self._recorded_codes(packed, result)
                if not out.put((packed, codes, margin, time.time(), time.perf_counter() - t0), packed_nbytes(packed)):
                    return  # the consumer stopped
        except BaseException as e:  # handed to the consumer, raised where its batch would have been
            out.put(e, 0)
        out.put(None, 0)

    def iterate(self, micro_batches: Sequence[MicroBatch | Iterable[tuple[str, int, int]]], *,
                trajectories: Mapping[str, Any] | None = None) -> Iterator[FeedBatch]:
        """`FeedBatch` es of this rank's slice of ``micro_batches``, in order, read ahead in the background.

        ``trajectories``: traj_id -> an object with ``records`` (its committed `tracestore.CommittedRecord`s) and
        ``result`` (its `tracestore.Result`), e.g. `tracerl.train.Trajectory`: read from those records (no log
        index); default: a Reader of the newest snapshot.

        Raises (when the batch is due) `ConfigError` for a malformed micro-batch, tracestore's `HintNotFoundError`
        for a trajectory or range the store does not hold, `IntegrityError` / `BackendError` from the store."""
        mbs = [_micro_batch(mb) for mb in micro_batches]
        if self.dp is not None:
            mbs = dp_shard(mbs, *self.dp)
        if self.cp is not None:
            mbs = [cp_shard(mb, *self.cp) for mb in mbs]
        if trajectories is not None:
            source = RecordSource(self.store, trajectories)
            result = lambda t: trajectories[t].result  # noqa: E731
        else:
            if self._reader is None:
                self._reader = SnapshotSource(self.store)
            source = self._reader
            result = source.result
        if self.reader == "process" and self._process is None:
            self._process = ReaderProcess(self.store)
        queue = _Queue(self.read_ahead_bytes)
        thread = threading.Thread(target=self._producer, args=(mbs, source, result, queue, trajectories),
                                  daemon=True, name="tracerl-hint-feed")
        thread.start()
        try:
            while True:
                item = queue.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                packed, codes, margin, loaded, secs = item
                yield self._on_device(packed, codes, loaded, secs, result, margin)
        finally:
            queue.close()
            thread.join()

    def _on_device(self, packed: PackedHints, codes: dict, loaded: float, secs: float, result,
                   margin: dict | None = None) -> FeedBatch:
        dev = self.device
        if margin is None and self.margin_on_device and packed.margin:  # decoded here, on the device
            margin = unpack_sites({s: compact.packed_from_store(self.store.sites[s], rows)
                                   for s, rows in packed.margin.items()}, dev, self.margin_decode)

        def put(a: np.ndarray, dtype=None) -> torch.Tensor:
            t = torch.from_numpy(np.ascontiguousarray(a))
            return to_device(t if dtype is None else t.to(dtype), dev)

        lens = np.diff(packed.cu_seqlens)
        versions = packed.policy_versions
        if versions is None:
            versions = np.full(len(packed.token_ids), -1, dtype=np.int64)  # a source that does not record them
        return FeedBatch(
            segments=packed.segments, cu_seqlens=put(packed.cu_seqlens, torch.int32),
            max_seqlen=int(lens.max()) if lens.size else 0, token_ids=put(packed.token_ids),
            positions=put(packed.positions), logprobs=put(packed.logprobs),
            policy_versions=put(versions),
            hints={s: put(a) for s, a in packed.hints.items()}, scales={s: put(a) for s, a in packed.scales.items()},
            global_scales={s: to_device(g, dev) for s, g in self.global_scales.items()},
            experts={la: put(a) for la, a in packed.experts.items()},
            rewards=put(np.array([_reward(result(s.traj_id)) for s in packed.segments], dtype=np.float32)),
            features=dict(self.features), scale_encodings=dict(self.scale_encodings), host=packed,
            loaded_unix=loaded, read_s=secs,
            codes={s: put(a) for s, a in codes.items()},
            margin={s: dataclasses.replace(e, **{f: to_device(getattr(e, f), dev) for f in e.TENSORS})
                    for s, e in (margin or {}).items()})

    def close(self) -> None:
        """End the reader process, if one was started (``reader="process"``; each `iterate` joins its own reading
        thread). The feed can iterate again afterwards (a new process starts)."""
        process, self._process = self._process, None
        if process is not None:
            process.close()

    def __enter__(self) -> HintFeed:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Queue:
    """A FIFO whose items hold at most ``cap`` bytes together (an item larger than the cap is let in alone);
    `close` wakes and stops the producer."""

    def __init__(self, cap: int):
        self.cap, self.held, self.items, self.closed = cap, 0, [], False
        self.cond = threading.Condition()

    def put(self, item: Any, nbytes: int) -> bool:
        with self.cond:
            while not self.closed and self.items and self.held + nbytes > self.cap:
                self.cond.wait()
            if self.closed:
                return False
            self.items.append((item, nbytes))
            self.held += nbytes
            self.cond.notify_all()
            return True

    def get(self) -> Any:
        with self.cond:
            while not self.items:
                self.cond.wait()
            item, nbytes = self.items.pop(0)
            self.held -= nbytes
            self.cond.notify_all()
            return item

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
