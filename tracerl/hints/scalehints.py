"""Scale hints: a store site that keeps one bit per NVFP4 block instead of its E4M3 scale byte (the store's scale
encoding ``lsb``, FORMAT §2.4; issue 23, stage 2).

**Layout.** Per token and site of width W, the scale row is ``ceil(W/16/8)`` bytes: bit b (LSB first: bit ``b % 8``
of byte ``b // 8``) is the LSB of block b's E4M3 scale byte; bits past the last block are 0 (`pack_scale_lsb`,
`unpack_scale_lsb`). With the W/8 hint bytes that is W/8 + W/128 bytes per token instead of W/8 + W/16 (0.71x).

**The trainer's rule** (`reconstruct_scales`; the rule of `tracerl.hints.compact.reconstruct` with
``scale_payload="lsb"`` and every block marked, the same function `compact.scale_hint_bytes`): from its own
activation x' it computes each block's ``t = clamp((amax / 6) / g, 2^-9, 448)`` (NUMERICS §3, the rollout's g) and
its E4M3 position w(t); of the two bytes ``b = min(floor(w), 125)`` and ``b + 1`` around it, it takes the one whose
LSB is stored. That is the rollout's byte whenever ``|w_t - w_r| < 1/2``, in particular whenever x' equals the
rollout's x (then ``w_t = w_r`` and the rollout's byte is the nearest of the two). Then today's hint-guided
``tracefp4.fake_quantize(x', scales=, hints=)`` runs on the reconstructed bytes (`fake_quantize_scale_hints`), so
wherever the reconstructed byte is the rollout's, the forward is today's bit for bit.

Pure torch (runs where x is, GPU included; no host sync): the definition. The trainer's forward runs the same rule
fused into its fake quantization, `tracefp4.fake_quantize_lsb` (Triton: one pass over x; tests check it equals
`reconstruct_scales` + `tracefp4.fake_quantize` bit for bit). `use_store_scale_encodings` tells a trainer's
`tracerl.policy.FP4Runtime` which sites of a store carry scale hints; its hinted quantization then reconstructs the
bytes itself (`FP4Runtime.set_scale_encodings`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

import tracefp4
from tracefp4.constants import HINTS_PER_BYTE, NVFP4_BLOCK_SIZE
from tracerl.config import SCALE_ENCODINGS
from tracerl.errors import ConfigError
from tracerl.hints.compact import _check_u8, _check_x, _global_scale, block_scale_t, scale_hint_bytes

__all__ = ["SCALE_ENCODINGS", "scale_lsb_bytes", "pack_scale_lsb", "unpack_scale_lsb", "reconstruct_scales",
           "fake_quantize_scale_hints", "scale_encodings", "use_store_scale_encodings", "scale_bytes_per_token"]

log = logging.getLogger(__name__)

BLOCK = NVFP4_BLOCK_SIZE


def scale_lsb_bytes(blocks: int) -> int:
    """Bytes of a scale-hint row of ``blocks`` blocks: ``ceil(blocks / 8)``."""
    return -(-int(blocks) // HINTS_PER_BYTE)


def scale_bytes_per_token(width: int, encoding: str) -> int:
    """Stored scale bytes per token of an NVFP4 site of ``width`` values: W/16 (bytes) or ceil(W/128) (lsb).
    Raises `ConfigError` for an unknown encoding."""
    if encoding not in SCALE_ENCODINGS:
        raise ConfigError(f"unknown scale encoding {encoding!r}; supported: {', '.join(SCALE_ENCODINGS)}")
    blocks = width // BLOCK
    return blocks if encoding == "bytes" else scale_lsb_bytes(blocks)


def pack_scale_lsb(scales_e4m3: torch.Tensor) -> torch.Tensor:
    """Scale hints of E4M3 scale bytes: uint8 [..., NB] -> uint8 [..., ceil(NB/8)], bit b = LSB of block b (LSB
    first, bits past NB zero). Device work only.

    Raises tracefp4's `DTypeError` (not uint8) / `ShapeError` (0-d or NB = 0)."""
    if not isinstance(scales_e4m3, torch.Tensor) or scales_e4m3.dtype != torch.uint8:
        got = scales_e4m3.dtype if isinstance(scales_e4m3, torch.Tensor) else type(scales_e4m3).__name__
        raise tracefp4.DTypeError(f"scales_e4m3 must be a uint8 tensor of E4M3 bytes; got {got}")
    if scales_e4m3.dim() < 1 or scales_e4m3.shape[-1] == 0:
        raise tracefp4.ShapeError(f"scales_e4m3 must be [..., NB] with NB >= 1; got {list(scales_e4m3.shape)}")
    nb = scales_e4m3.shape[-1]
    bits = scales_e4m3 & 1
    pad = scale_lsb_bytes(nb) * HINTS_PER_BYTE - nb
    if pad:
        bits = F.pad(bits, (0, pad))
    return tracefp4.pack_hints(bits)


def unpack_scale_lsb(scale_lsb: torch.Tensor, blocks: int) -> torch.Tensor:
    """The inverse of `pack_scale_lsb`: uint8 [..., ceil(blocks/8)] -> uint8 [..., blocks] of 0/1.

    Raises tracefp4's `DTypeError` (not uint8) / `ShapeError` (the last dim is not ``ceil(blocks / 8)``)."""
    if not isinstance(scale_lsb, torch.Tensor) or scale_lsb.dtype != torch.uint8:
        got = scale_lsb.dtype if isinstance(scale_lsb, torch.Tensor) else type(scale_lsb).__name__
        raise tracefp4.DTypeError(f"scale_lsb must be a uint8 tensor; got {got}")
    want = scale_lsb_bytes(blocks)
    if scale_lsb.dim() < 1 or scale_lsb.shape[-1] != want:
        raise tracefp4.ShapeError(f"scale_lsb of {blocks} blocks must be [..., {want}] (ceil({blocks} / 8) bytes); "
                                  f"got {list(scale_lsb.shape)}")
    return tracefp4.unpack_hints(scale_lsb)[..., :blocks]


def reconstruct_scales(x_hp: torch.Tensor, global_scale, scale_lsb: torch.Tensor) -> torch.Tensor:
    """The rollout's E4M3 scale bytes as the trainer works them out (module docstring): uint8 [T, W/16] from its
    activation ``x_hp`` [T, W] (bf16/fp16/fp32, W a multiple of 16), the site's fp32 ``global_scale`` (a positive
    float or a 1-element floating tensor, as the rollout divided by) and the stored scale hints ``scale_lsb`` uint8
    [T, ceil(W/128)]. Every byte is in [1, 126]; non-finite values count as 0 in a block's amax (as in
    `tracefp4.quantize`). Exact (equal to the rollout's byte) wherever the trainer's block scale position lies within
    1/2 E4M3 step of the rollout's; in particular for x equal to the rollout's.

    Raises tracefp4's `DTypeError` / `ShapeError` for tensors of the wrong dtype or shape, `ConfigError` for a bad
    global scale."""
    t_, w = _check_x(x_hp, "x_hp")
    _check_u8(scale_lsb, "scale_lsb", (t_, scale_lsb_bytes(w // BLOCK)))
    g = _global_scale(global_scale, x_hp.device)
    lsb = unpack_scale_lsb(scale_lsb.to(x_hp.device), w // BLOCK)  # [T, W/16]
    return scale_hint_bytes(block_scale_t(x_hp.float(), g), lsb)


def fake_quantize_scale_hints(x_hp: torch.Tensor, global_scale, scale_lsb: torch.Tensor,
                              hints_packed: torch.Tensor | None, *, backend: str = "auto") -> torch.Tensor:
    """Hint-guided NVFP4 fake quantization [T, W] (x's dtype, straight-through backward) at a site stored with scale
    hints: `reconstruct_scales`, then today's ``tracefp4.fake_quantize(x, scales=, hints=)`` (``hints_packed``
    uint8 [T, W/8], or None for round-to-nearest with the reconstructed scales). Raises as `reconstruct_scales` and
    `tracefp4.fake_quantize` do. (`tracefp4.fake_quantize_lsb` computes the same in one pass, as the trainer's
    forward does; this two-step form is the readable definition the tests hold it to.)"""
    scales = reconstruct_scales(x_hp, global_scale, scale_lsb)
    g = _global_scale(global_scale, x_hp.device)
    return tracefp4.fake_quantize(x_hp, "nvfp4", global_scale=g, scales=scales, hints=hints_packed, backend=backend)


def scale_encodings(source: Any) -> dict[str, str]:
    """{site: scale encoding} of a `tracestore.Store` (its manifest's sites), or of a mapping given as it is
    (checked). Raises `ConfigError` for an unknown encoding or a source of another type."""
    if hasattr(source, "sites") and isinstance(getattr(source, "sites"), Mapping):
        return {name: site.scale_encoding for name, site in source.sites.items()}
    if isinstance(source, Mapping):
        bad = {s: e for s, e in source.items() if e not in SCALE_ENCODINGS}
        if bad:
            raise ConfigError(f"scale encodings {bad}: each must be one of {', '.join(SCALE_ENCODINGS)}")
        return dict(source)
    raise ConfigError(f"scale encodings come from a tracestore Store or a {{site: encoding}} mapping; got "
                      f"{type(source).__name__}")


def use_store_scale_encodings(runtime: Any, source: Any) -> dict[str, str]:
    """Tell ``runtime`` (a `tracerl.policy.FP4Runtime`) the scale encodings of ``source`` (a store or a mapping,
    `scale_encodings`) at the sites it hints; returns what it set. The trainer's one call after building its model
    from a store: its hinted sites then take the store's scale rows as they are read (scale bytes, or scale hints
    that the runtime reconstructs with `reconstruct_scales`).

    Raises `ConfigError` as `scale_encodings` and `FP4Runtime.set_scale_encodings` do."""
    enc = scale_encodings(source)
    hinted = set(runtime.plan.hinted)
    chosen = {s: e for s, e in enc.items() if s in hinted}
    runtime.set_scale_encodings(chosen)  # the fused tracefp4.fake_quantize_lsb: this module's rule in one pass
    lsb = sorted(s for s, e in chosen.items() if e == "lsb")
    if lsb:
        log.info("tracerl.hints: %d hinted sites carry scale hints (scale bytes reconstructed): %s", len(lsb),
                 ", ".join(lsb[:4]) + (" ..." if len(lsb) > 4 else ""))
    return chosen
