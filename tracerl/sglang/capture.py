"""Exact capture of SGLang's FP4 codes at the MoE input, graph-safe, kept per KV slot (as SGLang keeps routes).

What is stored is what the engine computed: hint bits are the LSBs of SGLang's own E2M1 codes
(`tracefp4.hints_from_codes`) and scale bytes are its own E4M3 bytes; nothing is recomputed.

Data path (the same one SGLang's routed-experts capturer takes, `state_capturer/base.py` in the 0.5.23 wheel):

1. **in the forward** (eager, or recorded once into a CUDA graph and replayed): `SlotCapture.capture` writes, for
   each hinted layer, the hint bits, scale bytes, the scale multiplier the quantizer was called with and a
   forward tag into a static device buffer ``stage`` uint8 [max_rows, row_bytes], row i = row i of the forward.
   The tag is read from a device counter that `SlotCapture.take` advances before every forward, so a graph
   replay writes the current tag; a hinted layer whose hook did not run leaves a stale tag, which is caught.
2. **after the forward** (host code, every step, no sync): `SlotCapture.take` clones ``stage[:n]`` (n = the
   forward's real tokens: padded CUDA-graph rows are dropped) and the forward's KV slots into a `StepCapture`.
3. **SGLang's result copy**: `StepCapture.map_device_tensors` (copied to pinned host memory by SGLang's own
   asynchronous copy, overlap scheduler included) and `StepCapture.finalize` (after SGLang waited for that
   copy) put the rows into the host cache ``host`` uint8 [kv slots, row_bytes] at the tokens' KV slots.
4. **at the request's finish**: `SlotCapture.rows` gathers the request's KV slots (prefix-cache hits included:
   a cached token's slot holds what the forward that computed it captured).

Row layout per hinted site of width W (NVFP4, block 16): hints W/8 bytes, scales W/16 bytes, the multiplier
(fp32, 4 bytes), the tag (int32, 4 bytes).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping

import numpy as np
import torch

import tracefp4
from tracefp4.constants import HINTS_PER_BYTE, NVFP4_BLOCK_SIZE
from tracerl.sglang.errors import CaptureError

log = logging.getLogger(__name__)

__all__ = ["SWIZZLE_ROWS", "SWIZZLE_COLS", "CapturedRows", "SlotCapture", "StepCapture", "chain_outputs",
           "unswizzle_scales"]

#: the 128x4 tile of swizzled NVFP4 scale factors (flashinfer ``nvfp4_block_scale_interleave``)
SWIZZLE_ROWS, SWIZZLE_COLS = 128, 4


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def unswizzle_scales(sf: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Linear scale bytes uint8 [rows, cols] from 128x4-swizzled ones (any 1-byte dtype, [R', C'] or flat).

    The swizzled matrix is padded to R' = round_up(rows, 128), C' = round_up(cols, 4) and stored tile by tile:
    byte ``((tr * C'/4 + tc) * 32 + r % 32) * 16 + (r % 128) // 32 * 4 + c % 4`` holds (r, c), with tr = r // 128,
    tc = c // 4. Padding rows and columns are cut.

    Raises:
        CaptureError: ``sf`` does not hold R' * C' bytes.
    """
    rp, cp = _round_up(rows, SWIZZLE_ROWS), _round_up(cols, SWIZZLE_COLS)
    if sf.numel() != rp * cp:
        raise CaptureError(f"swizzled scales of shape {tuple(sf.shape)} hold {sf.numel()} bytes; {rows} x {cols} "
                           f"scales swizzled in 128x4 tiles are {rp} x {cp} = {rp * cp}")
    t = sf.contiguous().view(torch.uint8).reshape(rp // 128, cp // 4, 32, 4, 4)  # [tr, tc, r%32, r%128//32, c%4]
    t = t.permute(0, 3, 2, 1, 4)  # [tr, r%128//32, r%32, tc, c%4]
    return t.reshape(rp, cp)[:rows, :cols]


@dataclasses.dataclass(frozen=True)
class _SiteCols:
    """Byte columns of one site in a capture row."""

    hints: slice
    scales: slice
    multiplier: slice
    tag: slice


@dataclasses.dataclass
class CapturedRows:
    """One request's captured rows per site, gathered from its KV slots (host numpy).

    ``hints`` uint8 [n, W/8], ``scales`` uint8 [n, W/16], ``multiplier`` float32 [n] (the value SGLang passed as
    ``input_scale_quant``), ``valid`` bool [n] (the row was written by the forward that filled its slot)."""

    hints: dict[str, np.ndarray]
    scales: dict[str, np.ndarray]
    multiplier: dict[str, np.ndarray]
    valid: np.ndarray


class SlotCapture:
    """Static device capture of the hinted MoE inputs and its host cache indexed by KV slot.

    Parameters
    ----------
    layer_sites: {SGLang ``layer.layer_id``: site name} of the hinted layers.
    width: the hidden size H (the site width); SGLang's codes may be wider (padded hidden sizes): cut to H.
    max_rows: the most tokens one forward can hold (CUDA-graph padding included).
    num_slots: KV slots (the host cache's rows: what ``req_to_token`` indexes).
    device: where the forward runs. pin: pinned host cache (asynchronous copies; default: on CUDA).

    Raises `CaptureError` for a width that is not a multiple of 16 or sizes < 1.
    """

    def __init__(self, layer_sites: Mapping[int, str], width: int, *, max_rows: int, num_slots: int,
                 device: torch.device | str = "cpu", pin: bool | None = None):
        if width % NVFP4_BLOCK_SIZE or width < NVFP4_BLOCK_SIZE or max_rows < 1 or num_slots < 1 or not layer_sites:
            raise CaptureError(f"capture of width {width} (a multiple of {NVFP4_BLOCK_SIZE}), {max_rows} rows, "
                               f"{num_slots} KV slots, layers {sorted(layer_sites)}: all must be positive")
        self.device = torch.device(device)
        self.layer_sites = dict(layer_sites)
        self.width, self.max_rows, self.num_slots = width, max_rows, num_slots
        self.cols: dict[str, _SiteCols] = {}
        off = 0
        for site in self.layer_sites.values():
            nh, ns = width // HINTS_PER_BYTE, width // NVFP4_BLOCK_SIZE
            self.cols[site] = _SiteCols(slice(off, off + nh), slice(off + nh, off + nh + ns),
                                        slice(off + nh + ns, off + nh + ns + 4), slice(off + nh + ns + 4, off + nh + ns + 8))
            off += nh + ns + 8
        self.row_bytes = off
        pin = self.device.type == "cuda" if pin is None else pin
        self.stage = torch.zeros(max_rows, off, dtype=torch.uint8, device=self.device)  # [rows, row_bytes]
        self.host = torch.zeros(num_slots, off, dtype=torch.uint8, pin_memory=pin)  # [KV slots, row_bytes]
        self.tag = torch.zeros(1, dtype=torch.int32, device=self.device)  # device forward counter
        self.host_tag = 0  # its value as the host knows it (advanced in lockstep, never read back)
        self.host_valid = np.zeros(num_slots, dtype=bool)
        self.forwards = 0
        self.invalid_rows = 0

    @property
    def host_bytes(self) -> int:
        return self.host.numel()

    # ---- in the forward ---------------------------------------------------------------------------------
    def begin_forward(self) -> None:
        """Advance the forward tag (device and host), before the forward is launched or replayed."""
        self.tag.add_(1)
        self.host_tag += 1

    def capture(self, layer_id: int, codes: torch.Tensor, scales: torch.Tensor, multiplier: torch.Tensor) -> None:
        """Capture one MoE layer's quantized input as SGLang's TRT-LLM path made it: ``codes`` uint8 [T, Hp/2]
        (two E2M1 codes per byte, element 2i low), ``scales`` 1-byte [T, Hp/16] (float8_e4m3fn or uint8, linear
        layout), ``multiplier`` the fp32 ``input_scale_quant`` (one element, on the device) that scaled them.
        Hp >= H (padded hidden sizes: cut back to H). Device work only (graph-capturable); a layer that is not
        hinted is skipped.

        Raises:
            CaptureError: more rows than ``max_rows``, or codes/scales narrower than H or of unequal rows.
        """
        site = self.layer_sites.get(int(layer_id))
        if site is None:
            return
        t, w = codes.shape[0], self.width
        if codes.dim() != 2 or scales.dim() != 2 or scales.shape[0] != t or codes.shape[1] * 2 < w \
                or scales.shape[1] * NVFP4_BLOCK_SIZE < w or codes.dtype != torch.uint8 or scales.element_size() != 1:
            raise CaptureError(f"layer {layer_id}: codes {tuple(codes.shape)} {codes.dtype} and scales "
                               f"{tuple(scales.shape)} {scales.dtype}: expected uint8 [T, >= {w // 2}] and 1-byte "
                               f"[T, >= {w // NVFP4_BLOCK_SIZE}]")
        if t > self.max_rows:
            raise CaptureError(f"layer {layer_id}: a forward of {t} tokens exceeds the capture's {self.max_rows} "
                               "rows (raise max_rows: the most tokens a forward can hold)")
        c = self.cols[site]
        stage = self.stage[:t]
        stage[:, c.hints].copy_(tracefp4.hints_from_codes(codes[:, : w // 2]))
        stage[:, c.scales].copy_(scales.view(torch.uint8)[:, : w // NVFP4_BLOCK_SIZE])
        stage[:, c.multiplier].copy_(multiplier.reshape(1).to(torch.float32).view(torch.uint8).expand(t, 4))
        stage[:, c.tag].copy_(self.tag.view(torch.uint8).expand(t, 4))

    def capture_dispatched(self, layer_id: int, codes: torch.Tensor, scales: torch.Tensor,
                           multiplier: torch.Tensor) -> None:
        """`capture` for FP4 that a dispatcher delivered (``dispatch_output.hidden_states`` uint8 [T, H/2] and
        ``hidden_states_scale``): linear [T, H/16] scales are taken as they are, 128x4-swizzled ones (padded to
        [round_up(T, 128), round_up(H/16, 4)], or flat) are un-swizzled first (`unswizzle_scales`)."""
        t, ns = codes.shape[0], self.width // NVFP4_BLOCK_SIZE
        if scales.dim() == 2 and scales.shape[0] == t:
            linear = scales
        else:
            linear = unswizzle_scales(scales, t, max(ns, codes.shape[1] * 2 // NVFP4_BLOCK_SIZE))
        self.capture(layer_id, codes, linear, multiplier)

    # ---- after the forward --------------------------------------------------------------------------------
    def take(self, out_cache_loc: torch.Tensor) -> StepCapture:
        """The forward's captured rows and their KV slots (``out_cache_loc`` int [n], n the real tokens: rows past
        n are CUDA-graph padding and dropped), as a `StepCapture` for SGLang's result copy. Clones on the device
        (the next forward reuses the stage) and reads nothing back: no host sync."""
        n = out_cache_loc.shape[0]
        if n > self.max_rows:
            raise CaptureError(f"a forward of {n} tokens exceeds the capture's {self.max_rows} rows")
        self.forwards += 1
        return StepCapture(loc=out_cache_loc.reshape(-1).clone(), rows=self.stage[:n].clone(), owner=self,
                           tag=self.host_tag)

    def store_rows(self, loc: torch.Tensor, rows: torch.Tensor, tag: int) -> None:
        """Host side of `StepCapture.finalize`: rows whose every site carries ``tag`` are valid; all go in."""
        loc_np = loc.to("cpu").numpy().astype(np.int64, copy=False)
        rows_cpu = rows.to("cpu")
        if loc_np.size and (loc_np.min() < 0 or loc_np.max() >= self.num_slots):
            raise CaptureError(f"KV slots outside [0, {self.num_slots}): {loc_np.min()}..{loc_np.max()}")
        arr = rows_cpu.numpy()
        ok = np.ones(len(loc_np), dtype=bool)
        for c in self.cols.values():
            ok &= arr[:, c.tag].copy().view(np.int32).reshape(-1) == np.int32(tag)
        bad = int((~ok).sum())
        if bad:
            self.invalid_rows += bad
            log.error("tracerl.sglang: %d of %d rows of a forward were not written by its MoE hooks (a hinted layer "
                      "ran a path the plugin does not hook); their requests will not be recorded", bad, len(ok))
        idx = torch.from_numpy(loc_np)
        self.host.index_copy_(0, idx, rows_cpu)
        self.host_valid[loc_np] = ok

    # ---- at the finish ------------------------------------------------------------------------------------
    def rows(self, slots: np.ndarray) -> CapturedRows:
        """The host cache's rows at KV ``slots`` (int [n]) per site."""
        slots = np.asarray(slots, dtype=np.int64).reshape(-1)
        arr = self.host.numpy()[slots]  # [n, row_bytes]
        hints, scales, mult = {}, {}, {}
        for site, c in self.cols.items():
            hints[site] = arr[:, c.hints].copy()
            scales[site] = arr[:, c.scales].copy()
            mult[site] = arr[:, c.multiplier].copy().view(np.float32).reshape(-1)
        return CapturedRows(hints, scales, mult, self.host_valid[slots].copy())


@dataclasses.dataclass
class StepCapture:
    """One forward's capture on its way to the host cache, with SGLang's ``TopkCaptureOutput`` contract:
    ``map_device_tensors(fn)`` is called with SGLang's asynchronous device-to-host copy before its copy event is
    recorded, ``finalize()`` after SGLang waited for that event (or, without the overlap scheduler, on device
    tensors, copied then)."""

    loc: torch.Tensor  # int [n] KV slots
    rows: torch.Tensor  # uint8 [n, row_bytes]
    owner: SlotCapture
    tag: int

    def map_device_tensors(self, fn) -> None:
        self.loc = fn(self.loc)
        self.rows = fn(self.rows)

    def finalize(self) -> None:
        self.owner.store_rows(self.loc, self.rows, self.tag)


@dataclasses.dataclass
class _ChainedOutputs:
    """SGLang's own routed-experts output and ours in the one slot SGLang carries through its result lifecycle
    (``ModelRunnerOutput.routed_experts_output``); both get every call."""

    outputs: tuple

    def map_device_tensors(self, fn) -> None:
        for o in self.outputs:
            o.map_device_tensors(fn)

    def finalize(self) -> None:
        for o in self.outputs:
            o.finalize()


def chain_outputs(theirs, ours: StepCapture):
    """SGLang's routed-experts output (None when routes are not captured) with ``ours`` appended."""
    return ours if theirs is None else _ChainedOutputs((theirs, ours))
