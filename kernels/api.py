"""Public entry points of the FP4 numerics: `quantize`, `dequantize`, `fake_quantize`, `quantize_fake`.

Each takes ``backend="auto" | "reference" | "triton"``: "reference" is the pure-torch definition
(`tracefp4.reference`), "triton" the fused kernels (`tracefp4.triton_kernels`, bit-identical to the reference),
"auto" picks Triton when x is on CUDA and Triton imports, else the reference. Triton on CPU runs only under
``TRITON_INTERPRET=1`` (that is how the tests exercise it).

Layouts (x of shape ``[..., D]``, B = 16 for NVFP4, 32 for MXFP4; D must be a multiple of B)::

    codes  uint8 [..., D/2]   two E2M1 codes per byte, element 2i in the low nibble
    scales uint8 [..., D/B]   raw E4M3FN bits (NVFP4) or E8M0 bits (MXFP4)
    hints  uint8 [..., D/8]   LSB of each code, value 8j+b -> bit b of byte j
    global_scale  float32 0-d tensor (NVFP4 only)
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from . import reference as ref
from .constants import BACKENDS, BLOCK_SIZES, FORMATS, HINTS_PER_BYTE, MXFP4_SCALE_RULES, STE_MODES
from .errors import BackendError, DTypeError, FormatError, ShapeError
from .packing import unpack_codes, unpack_hints

__all__ = [
    "QuantizedFP4",
    "quantize",
    "dequantize",
    "fake_quantize",
    "quantize_fake",
    "compute_global_scale",
    "resolve_backend",
]

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class QuantizedFP4:
    """Result of `quantize`: the packed FP4 tensor of an input of shape ``[..., D]``.

    codes:        uint8 [..., D/2]  (two E2M1 codes per byte, element 2i low nibble)
    scales:       uint8 [..., D/B]  (E4M3FN bits for NVFP4, E8M0 bits for MXFP4)
    hints:        uint8 [..., D/8] or None (when quantized with ``emit_hints=False``)
    global_scale: float32 0-d tensor for NVFP4, None for MXFP4
    fmt:          "nvfp4" or "mxfp4"
    """

    codes: torch.Tensor
    scales: torch.Tensor
    hints: torch.Tensor | None
    global_scale: torch.Tensor | None
    fmt: str


# ---------------------------------------------------------------------------------------------------------
# argument checks
# ---------------------------------------------------------------------------------------------------------
def _check_fmt(fmt: str) -> int:
    if fmt not in FORMATS:
        raise FormatError(f"fmt must be one of {FORMATS}; got {fmt!r}")
    return BLOCK_SIZES[fmt]


def _check_float(x: torch.Tensor, name: str = "x") -> None:
    if not isinstance(x, torch.Tensor):
        raise DTypeError(f"{name} must be a torch.Tensor; got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise DTypeError(f"{name} must be one of {FLOAT_DTYPES}; got {x.dtype}")


def _check_x(x: torch.Tensor, fmt: str, name: str = "x") -> int:
    _check_float(x, name)
    block = _check_fmt(fmt)
    if x.dim() == 0 or x.shape[-1] % block != 0:
        raise ShapeError(
            f"{name} must have a last dimension that is a multiple of the {fmt} block size {block}; "
            f"got shape {tuple(x.shape)}"
        )
    return block


def _check_rule(scale_rule: str) -> None:
    if scale_rule not in MXFP4_SCALE_RULES:
        raise FormatError(f"scale_rule must be one of {MXFP4_SCALE_RULES}; got {scale_rule!r}")


def _as_u8(t: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise DTypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if t.dtype == torch.uint8:
        return t
    if t.dtype.itemsize == 1 and t.dtype not in (torch.bool,):
        return t.view(torch.uint8)  # e.g. torch.float8_e4m3fn / float8_e8m0fnu / int8 holding raw bits
    raise DTypeError(f"{name} must be uint8 (raw bits) or a 1-byte dtype; got {t.dtype}")


def _check_aux(t: torch.Tensor, name: str, x_shape: torch.Size, per: int) -> torch.Tensor:
    t = _as_u8(t, name)
    want = (*x_shape[:-1], x_shape[-1] // per)
    if tuple(t.shape) != want:
        raise ShapeError(f"{name} must have shape {want} for x of shape {tuple(x_shape)}; got {tuple(t.shape)}")
    return t


def _global_scale(global_scale, fmt: str, device: torch.device, x: torch.Tensor | None) -> torch.Tensor | None:
    """The fp32 0-d global scale on `device` (NVFP4), or None (MXFP4)."""
    if fmt == "mxfp4":
        if global_scale is None:
            return None
        gv = float(global_scale) if not isinstance(global_scale, torch.Tensor) else None
        if gv == 1.0 or (gv is None and global_scale.numel() == 1 and float(global_scale) == 1.0):
            return None
        raise FormatError(f"mxfp4 takes no global scale (None or 1.0); got {global_scale!r}")
    if global_scale is None:
        if x is None:
            raise FormatError("nvfp4 needs the global_scale that the codes/scales were made with; got None")
        return ref.global_scale_ref(x)
    if isinstance(global_scale, torch.Tensor):
        if (global_scale.dtype == torch.float32 and global_scale.dim() == 0 and not global_scale.requires_grad
                and global_scale.device == device):
            return global_scale  # already what the kernels take (a trainer's every call): no view, no copy
        if not global_scale.dtype.is_floating_point:
            raise DTypeError(f"global_scale must be a floating tensor; got dtype {global_scale.dtype}")
        if global_scale.numel() != 1:
            raise ShapeError(f"global_scale must have one element; got shape {tuple(global_scale.shape)}")
        # No host sync: the value is never read here (a device g stays put; a host g goes to the device with
        # non_blocking, which for pageable memory stages the 4 bytes at once and does not wait for the device).
        g = global_scale.detach().reshape(())
        non_blocking = g.device.type == "cpu" and torch.device(device).type == "cuda"
        return g.to(device=device, dtype=torch.float32, non_blocking=non_blocking)
    gv = float(global_scale)
    if not (gv > 0.0 and gv < float("inf")):
        raise FormatError(f"global_scale must be a positive finite number; got {global_scale!r}")
    # torch.full, not torch.tensor(gv, device=cuda): the latter is a blocking host -> device copy (a host sync).
    return torch.full((), gv, dtype=torch.float32, device=device)


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(backend: str, device: torch.device) -> str:
    """The backend that will run for tensors on `device`: "reference" or "triton"."""
    if backend not in BACKENDS:
        raise BackendError(f"backend must be one of {BACKENDS}; got {backend!r}")
    if backend == "reference":
        return "reference"
    if backend == "auto":
        return "triton" if device.type == "cuda" and _triton_importable() else "reference"
    if not _triton_importable():
        raise BackendError("backend='triton' needs the triton package, which is not importable here")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise BackendError(
            f"backend='triton' needs a CUDA tensor or TRITON_INTERPRET=1 in the environment; got device {device}"
        )
    return "triton"


@functools.cache
def _triton():
    """`tracefp4.triton_kernels`, imported on first use (it imports triton), then cached: every launch asks."""
    from . import triton_kernels

    return triton_kernels


def compute_global_scale(x: torch.Tensor) -> torch.Tensor:
    """Dynamic NVFP4 global scale of x (fp32 0-d): max(amax/2688, 2^-118) over finite values, 1.0 if amax == 0."""
    _check_float(x)
    return ref.global_scale_ref(x)


# ---------------------------------------------------------------------------------------------------------
# quantize / dequantize
# ---------------------------------------------------------------------------------------------------------
def quantize(
    x: torch.Tensor,
    fmt: str = "nvfp4",
    global_scale: torch.Tensor | float | None = None,
    backend: str = "auto",
    *,
    scale_rule: str = "floor",
    emit_hints: bool = True,
) -> QuantizedFP4:
    """Quantize x [..., D] (bf16/fp16/fp32) to FP4: codes, block scales, hint bits (and NVFP4 global scale).

    global_scale (NVFP4): the per-site fp32 scale g; None computes it from x (max(amax/2688, 2^-118) over
    finite values, 1.0 when amax == 0). MXFP4 takes none. scale_rule (MXFP4): "floor" (OCP) or "rceil".
    """
    block = _check_x(x, fmt)
    _check_rule(scale_rule)
    g = _global_scale(global_scale, fmt, x.device, x)
    be = resolve_backend(backend, x.device)
    lead, d = x.shape[:-1], x.shape[-1]
    xb = x.reshape(-1, block)  # [NB, B]
    if be == "triton":
        codes, scales, hints = _triton().quantize_blocks_triton(xb, fmt, g, scale_rule, emit_hints)
    else:
        codes, scales, hints = ref.quantize_blocks_ref(xb, fmt, g, scale_rule, emit_hints)
    return QuantizedFP4(
        codes=codes.reshape(*lead, d // 2),
        scales=scales.reshape(*lead, d // block),
        hints=None if hints is None else hints.reshape(*lead, d // HINTS_PER_BYTE),
        global_scale=g,
        fmt=fmt,
    )


def dequantize(
    q: QuantizedFP4 | torch.Tensor,
    scales: torch.Tensor | None = None,
    *,
    fmt: str | None = None,
    global_scale: torch.Tensor | float | None = None,
    dtype: torch.dtype = torch.bfloat16,
    backend: str = "auto",
) -> torch.Tensor:
    """Dequantize to ``dtype`` (bf16/fp16/fp32): ``sign * (E2M1[code] * s) * g`` in fp32, then cast (RNE).

    Either ``dequantize(q)`` with a `QuantizedFP4`, or ``dequantize(codes, scales, fmt=..., global_scale=...)``
    with packed codes uint8 [..., D/2] and scale bytes [..., D/B]. Returns [..., D] in ``dtype``.
    Raises FormatError (no fmt/scales with a codes tensor, unknown fmt), DTypeError (dtype not a float type,
    codes/scales not 1-byte), ShapeError (scales of the wrong shape, a row length not a multiple of B)."""
    if isinstance(q, QuantizedFP4):
        codes, scales, fmt, g = q.codes, q.scales, q.fmt, q.global_scale
    else:
        if scales is None or fmt is None:
            raise FormatError("dequantize(codes, scales, fmt=...) needs scales and fmt when codes is a tensor")
        codes = _as_u8(q, "codes")
        g = None
    block = _check_fmt(fmt)
    if dtype not in FLOAT_DTYPES:
        raise DTypeError(f"dtype must be one of {FLOAT_DTYPES}; got {dtype}")
    be = resolve_backend(backend, codes.device)
    if codes.dim() == 0:
        raise ShapeError(f"codes must have at least one dimension; got shape {tuple(codes.shape)}")
    shape = torch.Size((*codes.shape[:-1], codes.shape[-1] * 2))
    if shape[-1] % block != 0:
        raise ShapeError(f"codes of shape {tuple(codes.shape)} hold {shape[-1]} values per row, "
                         f"not a multiple of the {fmt} block size {block}")
    scales = _check_aux(scales, "scales", shape, block)
    if g is None:
        g = _global_scale(global_scale, fmt, codes.device, None)
    if be == "triton":
        out = _triton().dequantize_blocks_triton(
            codes.reshape(-1, block // 2), scales.reshape(-1).to(codes.device), fmt, g, dtype)
    else:
        out = ref.dequantize_blocks_ref(unpack_codes(codes).reshape(-1, block), scales.reshape(-1), fmt, g, dtype)
    return out.reshape(shape)


# ---------------------------------------------------------------------------------------------------------
# fake quantize (autograd: straight-through)
# ---------------------------------------------------------------------------------------------------------
def _ste_backward(ctx, grad_out: torch.Tensor) -> torch.Tensor:
    """Gradient of x for the straight-through estimators: identity, or zero where |x * r| > 6 ("clip", from
    the saved x, g and scale bytes)."""
    if ctx.ste == "identity":
        return grad_out
    x, g, sb = ctx.saved_tensors
    block = BLOCK_SIZES[ctx.fmt]
    xb = x.reshape(-1, block)
    gb = grad_out.contiguous().reshape(-1, block)
    if ctx.backend == "triton":
        grad = _triton().fake_quantize_bwd_blocks_triton(gb, xb, ctx.fmt, g, sb.reshape(-1))
    else:
        grad = ref.fake_quantize_bwd_blocks_ref(gb, xb, ctx.fmt, g, sb.reshape(-1))
    return grad.reshape(x.shape)


class _NoGraphCtx:
    """What a `torch.autograd.Function`'s forward gets for ``ctx`` when it is called directly, without building a
    graph node: no input needs a gradient or grad mode is off (a no-gradient forward: a trainer's old-policy forward,
    an audit's replay, a rollout's decode). ``Function.apply`` there only adds host time (its bookkeeping on every
    call); the forward's arithmetic is the same either way."""

    def save_for_backward(self, *tensors: torch.Tensor) -> None:
        pass

    def mark_non_differentiable(self, *tensors: torch.Tensor) -> None:
        pass


def _needs_graph(*tensors: torch.Tensor | None) -> bool:
    """Whether a differentiable op on ``tensors`` must record an autograd node (grad mode on and an input that
    requires a gradient)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


class _FakeQuantizeFn(torch.autograd.Function):
    """Forward: FP4 fake quantization (RTN or hint-guided). Backward: straight-through; with ste="clip" the
    gradient is zeroed where |x * r| > 6 (computed from the same scales as the forward)."""

    @staticmethod
    def forward(ctx, x, g, scales_u8, hints_u8, fmt, backend, scale_rule, ste):
        block = BLOCK_SIZES[fmt]
        xb = x.reshape(-1, block)  # [NB, B]
        sb = None if scales_u8 is None else scales_u8.reshape(-1)  # [NB]
        if backend == "triton":
            hb = None if hints_u8 is None else hints_u8.reshape(-1, block // HINTS_PER_BYTE)
            out, sb_used = _triton().fake_quantize_blocks_triton(xb, fmt, g, sb, hb, scale_rule, ste == "clip")
        else:
            hb = None if hints_u8 is None else unpack_hints(hints_u8.reshape(-1, block // HINTS_PER_BYTE))
            if sb is None:
                sb = ref.scales_ref(xb.float(), fmt, g, scale_rule)
            out = ref.fake_quantize_blocks_ref(xb, fmt, g, sb, hb, scale_rule)
            sb_used = sb
        ctx.ste, ctx.fmt, ctx.backend = ste, fmt, backend
        if ste == "clip":
            ctx.save_for_backward(x, g, sb_used)
        return out.reshape(x.shape)

    @staticmethod
    def backward(ctx, grad_out):
        return _ste_backward(ctx, grad_out), None, None, None, None, None, None, None


def fake_quantize(
    x: torch.Tensor,
    fmt: str = "nvfp4",
    global_scale: torch.Tensor | float | None = None,
    scales: torch.Tensor | None = None,
    hints: torch.Tensor | None = None,
    backend: str = "auto",
    *,
    scale_rule: str = "floor",
    ste: str = "identity",
) -> torch.Tensor:
    """FP4 fake quantization of x [..., D] (bf16/fp16/fp32), output in x.dtype, differentiable.

    - ``scales=None, hints=None``: round to nearest (ties to even) with scales computed from x (NVFP4 global
      scale from x when ``global_scale`` is None);
    - ``scales`` given: round to nearest with the rollout's scales (NVFP4 then needs its ``global_scale``);
    - ``scales`` and ``hints`` given: hint-guided rounding (see NUMERICS.md).

    Backward: straight-through. ``ste="identity"`` (default) passes the gradient unchanged; ``ste="clip"``
    zeroes it where |x * r| > 6 (values beyond the FP4 range).
    """
    block = _check_x(x, fmt)
    _check_rule(scale_rule)
    if ste not in STE_MODES:
        raise FormatError(f"ste must be one of {STE_MODES}; got {ste!r}")
    if hints is not None and scales is None:
        raise FormatError("hint-guided fake quantization needs the rollout's scales with the hints; got scales=None")
    if scales is not None and fmt == "nvfp4" and global_scale is None:
        raise FormatError("nvfp4 with the rollout's scales needs the rollout's global_scale; got None")
    g = _global_scale(global_scale, fmt, x.device, x)
    if scales is not None:
        scales = _check_aux(scales, "scales", x.shape, block).to(x.device)
    if hints is not None:
        hints = _check_aux(hints, "hints", x.shape, HINTS_PER_BYTE).to(x.device)
    be = resolve_backend(backend, x.device)
    args = (x.contiguous(), g, scales, hints, fmt, be, scale_rule, ste)
    if _needs_graph(x, g):
        return _FakeQuantizeFn.apply(*args)
    return _FakeQuantizeFn.forward(_NoGraphCtx(), *args)


class _FakeQuantizeLsbFn(torch.autograd.Function):
    """Forward: NVFP4 fake quantization with scale hints (the scale bytes from x's own block amax and the stored
    LSBs), hint-guided or round to nearest. Backward: straight-through, as `fake_quantize`."""

    @staticmethod
    def forward(ctx, x, g, lsb_u8, hints_u8, backend, ste):
        block = BLOCK_SIZES["nvfp4"]
        nbr = x.shape[-1] // block
        lsb_rows = lsb_u8.reshape(-1, lsb_u8.shape[-1])  # [rows, ceil(nbr / 8)] (explicit width: rows may be 0)
        xb = x.reshape(-1, block)  # [NB, 16]
        if backend == "triton":
            hb = None if hints_u8 is None else hints_u8.reshape(-1, block // HINTS_PER_BYTE)
            out, sb = _triton().fake_quantize_blocks_triton(xb, "nvfp4", g, None, hb, scale_lsb=lsb_rows,
                                                            lsb_blocks_per_row=nbr)
        else:
            bits = unpack_hints(lsb_rows)[:, :nbr].reshape(-1)  # [NB]
            sb = ref.nvfp4_lsb_scales_ref(xb.float(), g, bits)
            hb = None if hints_u8 is None else unpack_hints(hints_u8.reshape(-1, block // HINTS_PER_BYTE))
            out = ref.fake_quantize_blocks_ref(xb, "nvfp4", g, sb, hb)
        ctx.ste, ctx.fmt, ctx.backend = ste, "nvfp4", backend
        if ste == "clip":
            ctx.save_for_backward(x, g, sb)
        scales = sb.reshape(*x.shape[:-1], nbr)
        ctx.mark_non_differentiable(scales)
        return out.reshape(x.shape), scales

    @staticmethod
    def backward(ctx, grad_out, _gs):
        return _ste_backward(ctx, grad_out), None, None, None, None, None


def fake_quantize_lsb(
    x: torch.Tensor,
    global_scale: torch.Tensor | float,
    scale_lsb: torch.Tensor,
    hints: torch.Tensor | None = None,
    backend: str = "auto",
    *,
    ste: str = "identity",
) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 fake quantization of x [..., D] with *scale hints* instead of scale bytes (NUMERICS §11): each
    block's E4M3 byte is the one of the two around x's own ``t = clamp((amax / 6) / g, 2^-9, 448)`` whose LSB
    ``scale_lsb`` stores; then hint-guided rounding with ``hints`` (uint8 [..., D/8]), or round to nearest
    (None), exactly as `fake_quantize` with those bytes. One pass over x on the Triton backend.

    ``global_scale``: the rollout's fp32 g (positive finite number or one-element tensor); ``scale_lsb``: uint8
    [..., ceil(D/16/8)], bit b (LSB first) of a row is block b's LSB. Returns ``(y, scales)``: y [..., D] in
    x.dtype (differentiable, straight-through backward, ``ste`` as in `fake_quantize`) and the E4M3 bytes used,
    uint8 [..., D/16] (in [1, 126]).

    Raises `DTypeError` (x not bf16/fp16/fp32, aux tensors not 1-byte), `ShapeError` (D not a multiple of 16,
    aux shapes), `FormatError` (bad global scale or ste)."""
    block = _check_x(x, "nvfp4")
    if ste not in STE_MODES:
        raise FormatError(f"ste must be one of {STE_MODES}; got {ste!r}")
    if global_scale is None:
        raise FormatError("scale hints need the rollout's global_scale; got None")
    g = _global_scale(global_scale, "nvfp4", x.device, x)
    nbr = x.shape[-1] // block
    lsb = _as_u8(scale_lsb, "scale_lsb")
    want = (*x.shape[:-1], -(-nbr // HINTS_PER_BYTE))
    if tuple(lsb.shape) != want:
        raise ShapeError(f"scale_lsb must have shape {want} (ceil({nbr} blocks / 8) bytes per row) for x of shape "
                         f"{tuple(x.shape)}; got {tuple(lsb.shape)}")
    lsb = lsb.to(x.device)
    if hints is not None:
        hints = _check_aux(hints, "hints", x.shape, HINTS_PER_BYTE).to(x.device)
    be = resolve_backend(backend, x.device)
    args = (x.contiguous(), g, lsb.contiguous(), hints, be, ste)
    if _needs_graph(x, g):
        return _FakeQuantizeLsbFn.apply(*args)
    return _FakeQuantizeLsbFn.forward(_NoGraphCtx(), *args)


class _QuantizeFakeFn(torch.autograd.Function):
    """Forward: `quantize` and round-to-nearest `fake_quantize` of x in one pass (Triton) or from one set of
    scales (reference). Backward of the fake-quantized output: straight-through, as `fake_quantize`."""

    @staticmethod
    def forward(ctx, x, g, fmt, backend, scale_rule, emit_hints, ste, scales_out, hints_out, marks=None):
        block = BLOCK_SIZES[fmt]
        xb = x.reshape(-1, block)  # [NB, B]
        nb = xb.shape[0]
        s_out = None if scales_out is None else scales_out.view(nb)
        h_out = None if hints_out is None else hints_out.view(nb, block // HINTS_PER_BYTE)
        apart = marks  # the marks still to compute after the capture (None: none asked, or fused into it)
        if backend == "triton":
            tk = _triton()
            fused = None
            if marks is not None and (x.shape[-1] // block) % 8 == 0:  # whole bytes of block marks per row
                (vm, bm), thr, _ = marks
                fused = (vm.view(nb, block // HINTS_PER_BYTE), bm.view(-1), thr)
            try:
                y, codes, scales, hints = tk.quantize_fake_blocks_triton(xb, fmt, g, scale_rule, emit_hints,
                                                                         scales_out=s_out, hints_out=h_out,
                                                                         marks=fused)
                if fused is not None:
                    apart = None
            except tk.LaunchConfigError:  # a config the marks cannot fuse into: the same bits, marks apart
                if fused is None:
                    raise
                y, codes, scales, hints = tk.quantize_fake_blocks_triton(xb, fmt, g, scale_rule, emit_hints,
                                                                         scales_out=s_out, hints_out=h_out)
        else:
            codes, scales, hints = ref.quantize_blocks_ref(xb, fmt, g, scale_rule, emit_hints)
            y = ref.fake_quantize_blocks_ref(xb, fmt, g, scales, None, scale_rule)  # the same own scales
            if s_out is not None:
                scales = s_out.copy_(scales)
            if h_out is not None and hints is not None:
                hints = h_out.copy_(hints)
        if apart is not None:  # the marks as their own launch (reference backend, or not fusable here)
            from .margin import margin_marks

            (vm, bm), _, (m, ms) = apart
            d = x.shape[-1]
            margin_marks(x.reshape(-1, d), g, scales.view(-1, d // block), hints.view(-1, d // HINTS_PER_BYTE),
                         m, ms, backend=backend, out=(vm, bm))
        ctx.ste, ctx.fmt, ctx.backend = ste, fmt, backend
        if ste == "clip":
            ctx.save_for_backward(x, g, scales)
        if hints is None:
            hints = torch.empty(0, dtype=torch.uint8, device=x.device)
        ctx.mark_non_differentiable(codes, scales, hints)
        return y.reshape(x.shape), codes, scales, hints

    @staticmethod
    def backward(ctx, grad_y, _gc, _gs, _gh):
        return _ste_backward(ctx, grad_y), None, None, None, None, None, None, None, None, None


def _check_out(t: torch.Tensor | None, name: str, x: torch.Tensor, per: int) -> torch.Tensor | None:
    """A caller's output buffer for x (per: values per byte): as `_check_aux` (uint8 or a 1-byte dtype, the shape),
    and contiguous on x's device, since the kernel writes it in place (ShapeError / DTypeError)."""
    if t is None:
        return None
    t = _check_aux(t, name, x.shape, per)
    if not t.is_contiguous() or t.device != x.device:
        raise ShapeError(f"{name} must be a contiguous tensor on {x.device} (it is written in place); got "
                         f"{'a non-contiguous one' if not t.is_contiguous() else 'one'} on {t.device}")
    return t


def effective_codes(y: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor | float,
                    backend: str = "auto") -> torch.Tensor:
    """The E2M1 codes (uint8 [..., W], sign in bit 3) that an NVFP4 fake-quantized ``y`` [..., W] (bf16 / fp16 /
    fp32, e.g. `fake_quantize`'s output) carries, given the scale bytes it was made with (uint8 or another 1-byte
    dtype [..., W/16]) and its global scale (a one-element floating tensor, or a positive finite float): the code
    whose ladder value is nearest |y| / (s * g), with y's sign; 0 for ±0, for NaN / Inf ratios and where the scale
    is zero, negative or NaN (`reference.nvfp4_codes_ref`, which states the exact rule). What a trainer counts
    its code agreement with the rollout by. The Triton backend computes it in one pass over y (the reference
    takes a cast, a division, a bucketize with int64 buckets, a table look-up and a where: about 40 bytes of
    traffic per value instead of 3). Not differentiable.

    Raises DTypeError / ShapeError for tensors of another dtype or shape (saying which and what is expected),
    FormatError for a bad float global scale, BackendError for an unknown or unavailable backend."""
    _check_x(y, "nvfp4", "y")
    scales = _check_aux(scales, "scales", y.shape, BLOCK_SIZES["nvfp4"]).to(y.device)
    g = _global_scale(global_scale, "nvfp4", y.device, None)
    be = resolve_backend(backend, y.device)
    w = y.shape[-1]
    y2 = y.detach().reshape(-1, w)
    s2 = scales.reshape(-1, w // BLOCK_SIZES["nvfp4"])
    if be == "triton":
        from .triton_margin import nvfp4_codes_triton

        out = nvfp4_codes_triton(y2.contiguous(), s2.contiguous(), g)
    else:
        out = ref.nvfp4_codes_ref(y2, s2, g)
    return out.reshape(y.shape)


def fake_quantize_matrices(w: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """NVFP4 round-to-nearest fake quantization of a stack of matrices, each with its own dynamic global scale:
    for w [..., R, C] (bf16/fp16/fp32, C a multiple of 16), ``fake_quantize(w[i], "nvfp4")`` of every matrix
    ``w[i]`` of the stack (the leading dimensions flattened), bit for bit, stacked back to w's shape and dtype.

    The MoE expert weights of a trainer ([E, out, in] per layer), which its forward fake-quantizes after every
    optimizer step: the global scales are one reduction over the stack and the Triton backend quantizes the whole
    stack in one launch (per matrix: one reduction, a scale computation and one launch each). Not differentiable
    (no autograd graph): wrap it in a straight-through estimator for training.

    Raises ShapeError (fewer than 2 dimensions, C not a multiple of 16), DTypeError (not bf16/fp16/fp32),
    BackendError (an unavailable backend)."""
    _check_float(w, "w")
    if w.dim() < 2:
        raise ShapeError(f"w must be a stack of matrices [..., R, C]; got shape {tuple(w.shape)}")
    _check_x(w, "nvfp4", "w")
    with torch.no_grad():
        stack = w.detach().reshape(-1, *w.shape[-2:]).contiguous()  # [M, R, C]
        if stack.numel() == 0:
            return w.detach().clone()
        be = resolve_backend(backend, w.device)
        # [M] fp32 on w's device; Triton: one pass over the stack in two launches, not five passes
        g = _triton().global_scales_triton(stack) if be == "triton" else ref.global_scales_ref(stack)
        block = BLOCK_SIZES["nvfp4"]
        xb = stack.reshape(-1, block)
        if be == "triton":
            out, _ = _triton().fake_quantize_blocks_triton(xb, "nvfp4", g if g.numel() > 1 else g.reshape(()),
                                                           None, None)
        else:
            out = torch.cat([ref.fake_quantize_blocks_ref(m.reshape(-1, block), "nvfp4", g[i], None, None)
                             for i, m in enumerate(stack)])
        return out.reshape(w.shape)


def quantize_fake(
    x: torch.Tensor, fmt: str = "nvfp4", global_scale: torch.Tensor | float | None = None, backend: str = "auto",
    *, scale_rule: str = "floor", emit_hints: bool = True, ste: str = "identity",
    scales_out: torch.Tensor | None = None, hints_out: torch.Tensor | None = None,
    marks: tuple[float, float] | None = None,
    marks_out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, QuantizedFP4]:
    """The rollout's capture at a hinted site in one pass: ``(y, q)`` with

    - ``y`` = ``fake_quantize(x, fmt, global_scale=g)`` bit for bit (round to nearest with the block scales of
      x; [..., D] in x.dtype, NaN where x is NaN; differentiable, straight-through like `fake_quantize`), and
    - ``q`` = ``quantize(x, fmt, global_scale=g, emit_hints=emit_hints)`` bit for bit (codes, scales, hints,
      global scale), where g is ``global_scale`` or, when None, the dynamic NVFP4 global scale of x.

    The Triton kernel reads x once and writes y, codes, scales and hints (2 + 0.69 bytes per bf16 value instead
    of 2 + 2 + 2.69 for `quantize` followed by `fake_quantize`); it allocates only its outputs, reads no device
    value on the host and copies nothing host -> device, so it can run inside CUDA-graph capture (pass a
    device ``global_scale`` tensor, or None for dynamic scaling, which adds a torch reduction over x).
    ``scales_out`` ([..., D/block] uint8) and ``hints_out`` ([..., D/8] uint8), contiguous, on x's device: the
    scales and hints are written into these buffers instead of fresh tensors, and ``q.scales`` / ``q.hints`` are
    them (a CUDA-graph decode hands its capture buffers here, so recording costs no copy per site).
    ``marks`` = (margin, scale_margin) (NVFP4, with hints): also the site's margin exceptions,
    ``margin_marks(x2, g, q.scales, q.hints, margin, scale_margin)`` of x as rows x2 [T, D], written into
    ``marks_out`` = (value marks uint8 [T, D/8], block marks uint8 [T, ceil(D/128)]), bit for bit; the Triton
    kernel computes them in the same pass when D is a multiple of 128 (else, and on the reference backend, a
    `margin_marks` launch follows).

    Raises the errors of `quantize` (ShapeError, DTypeError, FormatError, BackendError), FormatError for an
    unknown ``ste``, ShapeError / DTypeError for an output buffer of another shape, layout, device or dtype, and
    with ``marks`` the errors of `margin_marks` (FormatError for a bad margin or MXFP4 / no hints, ShapeError
    without ``marks_out``).
    """
    _check_x(x, fmt)
    _check_rule(scale_rule)
    if ste not in STE_MODES:
        raise FormatError(f"ste must be one of {STE_MODES}; got {ste!r}")
    block = BLOCK_SIZES[fmt]
    scales_out = _check_out(scales_out, "scales_out", x, block)
    hints_out = _check_out(hints_out, "hints_out", x, HINTS_PER_BYTE) if emit_hints else None
    lead, d = x.shape[:-1], x.shape[-1]
    fused = None
    if marks is not None:
        from .margin import _fused_marks

        if fmt != "nvfp4" or not emit_hints:
            raise FormatError(f"margin marks are of NVFP4 sites with hints; got fmt={fmt!r}, emit_hints={emit_hints}")
        if not isinstance(marks, (tuple, list)) or len(marks) != 2:
            raise FormatError(f"marks must be (margin, scale_margin); got {marks!r}")
        marks_out, thr = _fused_marks(x.numel() // d, d, x.device, marks[0], marks[1], marks_out)
        fused = (marks_out, thr, (float(marks[0]), float(marks[1])))
    g = _global_scale(global_scale, fmt, x.device, x)
    be = resolve_backend(backend, x.device)
    y, codes, scales, hints = _QuantizeFakeFn.apply(x.contiguous(), g, fmt, be, scale_rule, emit_hints, ste,
                                                    scales_out, hints_out, fused)
    q = QuantizedFP4(
        codes=codes.reshape(*lead, d // 2),
        scales=scales.reshape(*lead, d // block),
        hints=hints.reshape(*lead, d // HINTS_PER_BYTE) if emit_hints else None,
        global_scale=g,
        fmt=fmt,
    )
    return y, q
