"""FP4 numerics of TRACE: bit-exact NVFP4/MXFP4 quantization, hint bits and hint-guided fake quantization.

Public API (see `tracefp4.api` and NUMERICS.md for formulas and byte layouts)::

    q = tracefp4.quantize(x, fmt="nvfp4", global_scale=None, backend="auto")   # -> QuantizedFP4
    q.codes, q.scales, q.hints, q.global_scale                                 # uint8, uint8, uint8, fp32
    y = tracefp4.dequantize(q, dtype=torch.bfloat16)
    y = tracefp4.fake_quantize(x, fmt="nvfp4", global_scale=g, scales=s, hints=h)  # hint-guided, STE backward
    y, q = tracefp4.quantize_fake(x, fmt="nvfp4", global_scale=g)   # the rollout's capture: RTN y + q, one pass
    y, s = tracefp4.fake_quantize_lsb(x, g, scale_lsb, hints=h)      # scale hints: bytes from x + stored LSBs
    tracefp4.pack_hints / unpack_hints / pack_codes / unpack_codes / hints_from_codes
    vm, bm = tracefp4.margin_marks(x, g, s, h, margin, scale_margin)  # margin exceptions: marks near boundaries
    s, h = tracefp4.margin_fill(x, g, vm, bm, stored_hints, stored_scales, "byte")  # the trainer's fill-in
    c = tracefp4.effective_codes(y, s, g)                            # the codes a fake-quantized y carries

`tracefp4.reference` is the pure-torch definition (no Triton needed); `tracefp4.triton_kernels` is imported
lazily (`tracefp4.margin` holds the margin-exception reference beside its API; `tracefp4.triton_margin` its kernels). This package imports nothing of tracestore or tracerl.
"""

import importlib
from typing import Any

# Public names -> the module that defines them, imported on first use (PEP 562): ``import tracefp4.constants``
# (format constants, for code that must not load torch, such as a command line checking its arguments) loads
# nothing heavy.
_EXPORTS = {
    "api": ("QuantizedFP4", "quantize", "dequantize", "fake_quantize", "fake_quantize_lsb", "fake_quantize_matrices",
            "quantize_fake", "effective_codes",
            "compute_global_scale",
            "resolve_backend"),
    "packing": ("pack_codes", "unpack_codes", "pack_hints", "unpack_hints", "hints_from_codes"),
    "errors": ("FP4Error", "ShapeError", "DTypeError", "FormatError", "LaunchConfigError", "BackendError"),
    "constants": ("BLOCK_SIZES", "E2M1_MAGNITUDES", "FORMATS"),
    "margin": ("margin_marks", "margin_fill"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
_SUBMODULES = ("api", "constants", "errors", "margin", "packing", "reference", "triton_kernels", "triton_margin")

__all__ = [name for names in _EXPORTS.values() for name in names]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(_SUBMODULES))
