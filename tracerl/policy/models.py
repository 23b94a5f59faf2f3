"""Tiny random-init Hugging Face MoE models, built from configs (never downloaded).

Two families are supported, both with routed experts stored as 3-D parameters
(`mlp.experts.gate_up_proj` [E, 2*I, H], `mlp.experts.down_proj` [E, H, I]) and a top-k softmax
router (`mlp.gate`):

- ``qwen3-moe``: Qwen3-MoE (full attention in every layer).
- ``qwen3.5-moe``: Qwen3.5-MoE, the TRACE paper's architecture (3 of 4 layers Gated-DeltaNet linear
  attention, 1 of 4 full attention; a shared expert beside the routed ones).

Random init is seeded; weights are cast to bf16 after init so the rollout and the trainer start from the
same bf16 values.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch

from tracerl.config import TinyMoESpec

#: the name stores record for `build_model` in their model metadata (a stable identifier, not a module path:
#: tracerl 0.1 kept the builder in ``tracerl.policy.models``)
BUILDER = "tracerl.models.build_model"


def _hf_config(spec: TinyMoESpec) -> Any:
    common = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.top_k,
        moe_intermediate_size=spec.moe_intermediate_size,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        tie_word_embeddings=False,
    )
    if spec.family == "qwen3-moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            intermediate_size=spec.moe_intermediate_size * 2,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            **common,
        )
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(
        shared_expert_intermediate_size=spec.moe_intermediate_size,
        linear_num_key_heads=spec.num_heads,
        linear_num_value_heads=spec.num_heads,
        linear_key_head_dim=spec.head_dim,
        linear_value_head_dim=spec.head_dim,
        **common,
    )


def build_model(
    spec: TinyMoESpec, *, seed: int = 0, device: str | torch.device = "cpu", attn_implementation: str = "sdpa"
) -> torch.nn.Module:
    """A random-init causal LM for ``spec`` in bf16, eval mode, with the given attention implementation."""
    config = _hf_config(spec)
    config._attn_implementation = attn_implementation
    device = torch.device(device)
    if spec.family == "qwen3-moe":
        from transformers import Qwen3MoeForCausalLM as cls
    else:
        from transformers import Qwen3_5MoeForCausalLM as cls
    # Parameters are created and initialized on `device` (a large model inits in seconds on a GPU); the seed
    # makes the weights reproducible per device type.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), device:
        torch.manual_seed(seed)
        model = cls(config)
    model = model.to(dtype=torch.bfloat16)
    model.eval()
    return model


def model_metadata(spec: TinyMoESpec, seed: int) -> dict[str, Any]:
    """What the store records so that a trainer can rebuild the same model."""
    return {"builder": BUILDER, "seed": seed, "spec": dataclasses.asdict(spec)}


def has_linear_attention(model: torch.nn.Module) -> bool:
    """True for models whose token mixer cannot run packed sequences on the torch path (Gated DeltaNet)."""
    return any(getattr(layer, "block_type", None) == "linear_attention" for layer in model.model.layers)


def moe_layer_name(layer: int) -> str:
    """Module name of decoder layer ``layer``'s MoE block: the name its routed experts are recorded under (the
    store's ``moe_layers``, `tracerl.train.packing.PackedHints.experts`) and the prefix of its FP4 sites."""
    return f"model.layers.{layer}.mlp"


def attention_name(layer: int) -> str:
    """Module name of decoder layer ``layer``'s attention (prefix of its projection and KV-cache sites)."""
    return f"model.layers.{layer}.self_attn"


def moe_blocks(model: torch.nn.Module) -> list[tuple[int, str, torch.nn.Module]]:
    """(layer index, module name, block) of every sparse MoE block (has a router `gate` and `experts`)."""
    out = []
    for i, layer in enumerate(model.model.layers):
        mlp = getattr(layer, "mlp", None)
        if mlp is not None and hasattr(mlp, "experts") and hasattr(mlp, "gate"):
            out.append((i, moe_layer_name(i), mlp))
    return out


def cache_kwarg(model: torch.nn.Module) -> str:
    """The name of the KV-cache argument of ``model``'s forward (``cache`` or ``past_key_values``, by version)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"
