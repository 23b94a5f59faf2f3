"""FP4 numerics of TRACE: bit-exact NVFP4/MXFP4 quantization, hint bits and hint-guided fake quantization.

Public API (see `tracefp4.api` and NUMERICS.md for formulas and byte layouts)::

    q = tracefp4.quantize(x, fmt="nvfp4", global_scale=None, backend="auto")   # -> QuantizedFP4
    q.codes, q.scales, q.hints, q.global_scale                                 # uint8, uint8, uint8, fp32
    y = tracefp4.dequantize(q, dtype=torch.bfloat16)
    y = tracefp4.fake_quantize(x, fmt="nvfp4", global_scale=g, scales=s, hints=h)  # hint-guided, STE backward
    y, q = tracefp4.quantize_fake(x, fmt="nvfp4", global_scale=g)   # the rollout's capture: RTN y + q, one pass
    tracefp4.pack_hints / unpack_hints / pack_codes / unpack_codes / hints_from_codes

`tracefp4.reference` is the pure-torch definition (no Triton needed); `tracefp4.triton_kernels` is imported
lazily. This package imports nothing of tracestore or tracerl.
"""

from . import api
from .api import (
    QuantizedFP4,
    compute_global_scale,
    dequantize,
    fake_quantize,
    quantize,
    quantize_fake,
    resolve_backend,
)
from .constants import BLOCK_SIZES, E2M1_MAGNITUDES, FORMATS
from .errors import BackendError, DTypeError, FormatError, FP4Error, ShapeError
from .packing import hints_from_codes, pack_codes, pack_hints, unpack_codes, unpack_hints

__all__ = [
    *api.__all__,
    "pack_codes",
    "unpack_codes",
    "pack_hints",
    "unpack_hints",
    "hints_from_codes",
    "FP4Error",
    "ShapeError",
    "DTypeError",
    "FormatError",
    "BackendError",
    "BLOCK_SIZES",
    "E2M1_MAGNITUDES",
    "FORMATS",
]
