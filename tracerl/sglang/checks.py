"""Refuse, don't guess: the SGLang settings under which the plugin cannot record exactly (torch-free).

`refusals` reads SGLang's server arguments and environment and returns one line per setting that stops the
recording, each naming the setting and what to change. The plugin records where SGLang's own FP4 codes of the
MoE input pass through Python and follow the rule the hints cover: the FlashInfer TRT-LLM MoE backend's
``quantize_hidden_states_fp4`` (one fp32 multiplier per layer, E4M3 block scales of 16 values, RNE codes).
`quantizer_settings` is what a quantizer record keeps of those settings (`tracerl.sglang.quantizer`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["SUPPORTED_BACKENDS", "refusals", "quantizer_settings", "env_flag"]

#: MoE runner backends whose MoE-input codes the plugin sees (``auto`` resolves to the first on Blackwell)
SUPPORTED_BACKENDS = ("flashinfer_trtllm", "flashinfer_trtllm_routed")

_BACKEND_REASONS = {
    "flashinfer_cutlass": "quantizes the MoE input inside the fused CUTLASS kernel: SGLang's codes are not visible",
    "flashinfer_cutedsl": "quantizes inside the CuTe DSL MoE wrapper (and scales per token in its v2 path)",
    "flashinfer_megamoe": "quantizes inside the MegaMoE kernel",
    "marlin": "runs NVFP4 weights with bf16 activations (W4A16): there are no activation codes",
    "lora_marlin": "runs NVFP4 weights with bf16 activations (W4A16): there are no activation codes",
    "cutlass": "is not an NVFP4 MoE backend in SGLang 0.5.23",
}
_FIX_BACKEND = "start SGLang with --moe-runner-backend flashinfer_trtllm (Blackwell)"


def env_flag(env: Mapping[str, str], name: str) -> bool:
    """SGLang's reading of a boolean environment variable (``1``/``true``/``yes``/``on``, any case)."""
    return str(env.get(name, "")).strip().lower() in ("1", "true", "yes", "on", "y", "t")


def _arg(args: Any, name: str, default: Any = None) -> Any:
    return getattr(args, name, default)


def refusals(args: Any, env: Mapping[str, str], *, needs_routes: bool) -> list[str]:
    """One line per setting of ``args`` (SGLang's ``ServerArgs``) and ``env`` that the plugin cannot record
    under; empty when it can. ``needs_routes``: the store declares MoE layers (routed experts are recorded)."""
    out = []
    backend = str(_arg(args, "moe_runner_backend", "auto") or "auto")
    if backend != "auto" and backend not in SUPPORTED_BACKENDS:
        why = _BACKEND_REASONS.get(backend, "is not a backend whose NVFP4 MoE input the plugin knows")
        out.append(f"--moe-runner-backend {backend}: {why}; {_FIX_BACKEND}")
    a2a = str(_arg(args, "moe_a2a_backend", "none") or "none")
    if a2a != "none":
        out.append(f"--moe-a2a-backend {a2a}: the MoE input then reaches the experts as (token, expert rank) slots "
                   "after an all-to-all, not as the forward's tokens; use --moe-a2a-backend none")
    if _arg(args, "enable_dp_attention", False):
        out.append("--enable-dp-attention: the MoE input is gathered across DP ranks (rows of other ranks' "
                   "requests); start without it")
    if _arg(args, "enable_torch_compile", False):
        out.append("--enable-torch-compile: compiled regions may not call the Python functions the plugin hooks; "
                   "start without it (CUDA graphs are fine)")
    spec = _arg(args, "speculative_algorithm")
    if spec not in (None, "", "none", "NONE"):
        out.append(f"--speculative-algorithm {spec}: draft and verify forwards write tokens that are later "
                   "rejected; start without speculative decoding")
    if int(_arg(args, "pp_size", 1) or 1) > 1:
        out.append("--pp-size > 1: the MoE layers of one request run in several processes; use --pp-size 1")
    if _arg(args, "enable_pdmux", False):
        out.append("--enable-pdmux: split prefill forwards are not hooked; start without it")
    disagg = str(_arg(args, "disaggregation_mode", "null") or "null")
    if disagg != "null":
        out.append(f"--disaggregation-mode {disagg}: prefill and decode of one request run on two servers; "
                   "start without disaggregation")
    quant = _arg(args, "quantization")
    if quant not in (None, "modelopt_fp4"):
        out.append(f"--quantization {quant}: the plugin records NVFP4 MoE layers (ModelOpt FP4 checkpoints, "
                   "--quantization modelopt_fp4)")
    if env_flag(env, "SGLANG_FLASHINFER_NVFP4_PER_TOKEN_ACTIVATION"):
        out.append("SGLANG_FLASHINFER_NVFP4_PER_TOKEN_ACTIVATION=1: per-token activation scales; the hint rule has "
                   "one global scale per site (NUMERICS.md §3); unset it")
    if env_flag(env, "FLASHINFER_NVFP4_4OVER6"):
        out.append("FLASHINFER_NVFP4_4OVER6=1: Four-over-Six picks each block's scale from two candidates, a rule "
                   "the hints do not cover; unset it")
    if needs_routes and not _arg(args, "enable_return_routed_experts", False):
        out.append("the store declares MoE layers (routed experts are recorded): start SGLang with "
                   "--enable-return-routed-experts")
    return out


def quantizer_settings(args: Any, env: Mapping[str, str], *, backend: str, device_capability: tuple | None,
                       flashinfer_version: str | None) -> dict[str, Any]:
    """What a quantizer record keeps: which quantizer, with which options, made the MoE-input codes."""
    fast_math = not (env.get("FLASHINFER_DISABLE_FP4_QUANT_FAST_MATH", "0") != "0"
                     or env.get("TRTLLM_DISABLE_FP4_QUANT_FAST_MATH", "0") != "0")
    cap = None if device_capability is None else f"{device_capability[0]}.{device_capability[1]}"
    return {
        "engine": "sglang",
        "moe_runner_backend": backend,
        "quantizer": "flashinfer.fp4_quantize",
        # SGLang's fp4_utils picks FlashInfer's cute-dsl quantizer on SM100 and its CUDA one elsewhere
        "fp4_quantize_backend": "cute-dsl" if device_capability is not None and tuple(device_capability) == (10, 0)
        else "cuda",
        "flashinfer_version": flashinfer_version,
        "device_capability": cap,
        "sf_vec_size": 16,
        "sf_use_ue8m0": False,
        "e4m3_max": 448.0,
        "four_over_six": env_flag(env, "FLASHINFER_NVFP4_4OVER6"),
        "per_token_activation": env_flag(env, "SGLANG_FLASHINFER_NVFP4_PER_TOKEN_ACTIVATION"),
        "fast_math": fast_math,
        "nvfp4_dispatch": env_flag(env, "SGLANG_MOE_NVFP4_DISPATCH"),
        "multiplier": "input_scale_quant = fp32(1 / max(w13_input_scale))",
        "sites": "w13 input (the second expert GEMM's input is quantized inside the fused kernel: not recorded)",
    }
