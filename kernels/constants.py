"""Format constants of the FP4 numerics (NVFP4 and MXFP4).

Every number the formats are made of lives here; `kernels/NUMERICS.md` gives the formulas that use them.
Names carry the format they belong to (`E2M1_*`, `E4M3_*`, `E8M0_*`, `NVFP4_*`, `MXFP4_*`).
"""

from __future__ import annotations

# --- E2M1 (the 4-bit element): bit 3 sign, bits 2:1 exponent, bit 0 mantissa -------------------------------
#: magnitudes of codes 0..7 (code | 8 is the negative of code)
E2M1_MAGNITUDES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX: float = 6.0
#: round-to-nearest-even decision points between magnitude codes i and i+1 (midpoints), with the rule at an
#: exact tie: the tie goes to the even code, i.e. down when i is even (strict `>`), up when i is odd (`>=`).
E2M1_MIDPOINTS: tuple[float, ...] = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
#: the ladder magnitudes 1..6 that hint-guided rounding counts (`k = #{m in ladder : m <= a}`)
E2M1_HINT_LADDER: tuple[float, ...] = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0)

# --- NVFP4: blocks of 16, E4M3FN block scale, FP32 per-tensor global scale ----------------------------------
NVFP4_BLOCK_SIZE: int = 16
E4M3_MAX: float = 448.0
#: smallest positive E4M3FN value (subnormal 2^-9); block scales are clamped up to it
E4M3_MIN_SCALE: float = 2.0**-9
#: smallest E4M3FN normal (2^-6); below it the E4M3 grid is uniform with step 2^-9
E4M3_MIN_NORMAL: float = 2.0**-6
#: g = amax / (E4M3_MAX * E2M1_MAX) = amax / 2688
NVFP4_GLOBAL_DENOM: float = E4M3_MAX * E2M1_MAX
#: computed global scales are clamped to [NVFP4_GLOBAL_SCALE_MIN, +inf) so that r = (1/g)/s <= 2^127 stays
#: finite for every block scale s >= 2^-9
NVFP4_GLOBAL_SCALE_MIN: float = 2.0**-118
#: global scale used when the tensor has no finite non-zero value (amax == 0)
NVFP4_GLOBAL_SCALE_FALLBACK: float = 1.0

# --- MXFP4: blocks of 32, E8M0 block scale (2^(byte - 127)), no global scale ---------------------------------
MXFP4_BLOCK_SIZE: int = 32
E8M0_BIAS: int = 127
E8M0_MIN_EXP: int = -127
E8M0_MAX_EXP: int = 127
E8M0_NAN: int = 0xFF
#: OCP MX rule: e = floor(log2(amax)) - floor(log2(6)) = floor(log2(amax)) - 2
MXFP4_EMAX_ELEM: int = 2
MXFP4_SCALE_RULES: tuple[str, ...] = ("floor", "rceil")

# --- packing -----------------------------------------------------------------------------------------------
CODES_PER_BYTE: int = 2
HINTS_PER_BYTE: int = 8

FORMATS: tuple[str, ...] = ("nvfp4", "mxfp4")
BLOCK_SIZES: dict[str, int] = {"nvfp4": NVFP4_BLOCK_SIZE, "mxfp4": MXFP4_BLOCK_SIZE}
BACKENDS: tuple[str, ...] = ("auto", "reference", "triton")
#: straight-through estimator variants for the backward of fake quantization
STE_MODES: tuple[str, ...] = ("identity", "clip")
