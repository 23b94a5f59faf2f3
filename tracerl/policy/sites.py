"""Quantization sites: names shared by the rollout and the trainer, FP4 placement, hint coverage.

A *site* is one activation tensor that is NVFP4-quantized, named after the module whose GEMM consumes it:

| site name | tensor | width |
| --- | --- | --- |
| ``model.layers.{i}.mlp.experts.input`` | the MoE input (post-attention RMSNorm output) fed to the routed experts' gate/up GEMM, quantized once per token and shared by every routed expert | hidden |
| ``model.layers.{i}.mlp.experts.down_proj.input`` | the routed experts' down-GEMM inputs of one token, its top-k slots ordered by ascending expert id | top_k * moe_intermediate |
| ``model.layers.{i}.self_attn.{q,k,v,o}_proj.input`` | attention projection inputs (only with ``fp4="experts+attention"``) | in_features |
| ``model.layers.{i}.self_attn.{k,v}_cache`` | keys (after RoPE) and values as stored in the KV cache, one row per (token, KV head) (only with ``kv_fp4=True``; never hinted) | head_dim |

FP4 placement follows real NVFP4 checkpoints of these models: the routed experts' GEMMs (inputs and weights)
are FP4; attention, the router, the shared expert, embeddings and the LM head stay bf16. ``experts+attention``
additionally puts the attention projections of full-attention layers in FP4.

Hint coverage chooses which FP4 sites get hints recorded: by default the MoE input of the latter half of the
layers (the paper's default: the latter 20 of 40 layers of Qwen3.5-35B-A3B).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Sequence

import torch

from tracefp4.constants import NVFP4_BLOCK_SIZE
from tracerl.config import FP4_PLACEMENTS, HINT_SITE_KINDS, parse_layers
from tracerl.errors import ConfigError
from tracerl.policy.models import attention_name, moe_blocks, moe_layer_name

BLOCK = NVFP4_BLOCK_SIZE  # NVFP4 block along the last dim (tracefp4's constant, under the name tracerl uses)


def moe_input_site(layer: int) -> str:
    return f"{moe_layer_name(layer)}.experts.input"


def moe_down_site(layer: int) -> str:
    return f"{moe_layer_name(layer)}.experts.down_proj.input"


def linear_input_site(module_name: str) -> str:
    return f"{module_name}.input"


def kv_cache_sites(layer: int) -> tuple[str, str]:
    """(key, value) cache sites of decoder layer ``layer`` (NVFP4 along head_dim, never hinted)."""
    prefix = attention_name(layer)
    return f"{prefix}.k_cache", f"{prefix}.v_cache"


@dataclasses.dataclass(frozen=True)
class SiteSpec:
    """One FP4 activation site. ``layer`` is the decoder layer index; ``kind`` is moe_input|moe_down|linear|kv."""

    name: str
    width: int
    layer: int
    kind: str
    module: str

    def __post_init__(self) -> None:
        if self.width % BLOCK:
            raise ConfigError(f"site {self.name}: width {self.width} is not a multiple of the NVFP4 block ({BLOCK})")


@dataclasses.dataclass(frozen=True)
class SitePlan:
    """Every FP4 site of a model, the hinted subset, and whether expert weights are FP4."""

    sites: tuple[SiteSpec, ...]
    hinted: tuple[str, ...]
    fp4_weights: bool = True

    def __post_init__(self) -> None:
        names = {s.name for s in self.sites}
        missing = [h for h in self.hinted if h not in names]
        if missing:
            raise ConfigError(f"hinted sites {missing} are not FP4 sites of this plan")

    @property
    def has_kv(self) -> bool:
        """True when the KV cache is FP4 (``kv`` sites)."""
        return any(s.kind == "kv" for s in self.sites)

    @property
    def by_name(self) -> dict[str, SiteSpec]:
        return {s.name: s for s in self.sites}

    def hinted_specs(self) -> list[SiteSpec]:
        by = self.by_name
        return [by[h] for h in self.hinted]

    def to_json(self) -> dict:
        return {
            "sites": [dataclasses.asdict(s) for s in self.sites],
            "hinted": list(self.hinted),
            "fp4_weights": self.fp4_weights,
        }

    @classmethod
    def from_json(cls, obj: dict) -> "SitePlan":
        return cls(tuple(SiteSpec(**s) for s in obj["sites"]), tuple(obj["hinted"]), bool(obj["fp4_weights"]))


def plan_sites(
    model: torch.nn.Module,
    *,
    fp4: str = "experts",
    hint_layers: str | Sequence[int] = "latter-half",
    hint_sites: str | Sequence[str] = "moe-input",
    kv_fp4: bool = False,
) -> SitePlan:
    """The FP4 sites of ``model`` and the hinted subset.

    ``hint_sites``: ``moe-input`` (the MoE input of each hinted layer), ``all-fp4`` (every FP4 site of each
    hinted layer), or a sequence of fnmatch patterns over site names (then ``hint_layers`` is ignored).
    """
    if fp4 not in FP4_PLACEMENTS:
        raise ConfigError(f"fp4 placement {fp4!r}; supported: {', '.join(FP4_PLACEMENTS)}")
    cfg = model.config
    sites: list[SiteSpec] = []
    if fp4 != "none":
        for i, name, _block in moe_blocks(model):
            sites.append(SiteSpec(moe_input_site(i), cfg.hidden_size, i, "moe_input", f"{name}.experts"))
            sites.append(
                SiteSpec(
                    moe_down_site(i),
                    cfg.num_experts_per_tok * cfg.moe_intermediate_size,
                    i,
                    "moe_down",
                    f"{name}.experts",
                )
            )
    if fp4 == "experts+attention":
        for i, layer in enumerate(model.model.layers):
            attn = getattr(layer, "self_attn", None)
            if attn is None:
                continue
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                lin = getattr(attn, proj)
                mod = f"{attention_name(i)}.{proj}"
                sites.append(SiteSpec(linear_input_site(mod), lin.in_features, i, "linear", mod))
    if kv_fp4:
        for i, layer in enumerate(model.model.layers):
            if getattr(layer, "self_attn", None) is None:
                continue
            hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            for name in kv_cache_sites(i):
                sites.append(SiteSpec(name, hd, i, "kv", attention_name(i)))
    sites.sort(key=lambda s: (s.layer, s.name))
    names = [s.name for s in sites]
    if isinstance(hint_sites, str):
        if hint_sites not in HINT_SITE_KINDS:
            raise ConfigError(f"hint sites {hint_sites!r}; supported: {', '.join(HINT_SITE_KINDS)} or patterns")
        layers = set(parse_layers(hint_layers, cfg.num_hidden_layers))
        hinted = [
            s.name
            for s in sites
            if s.layer in layers and s.kind != "kv" and (hint_sites == "all-fp4" or s.kind == "moe_input")
        ]
    else:
        hinted = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in hint_sites)]
    kv_hinted = [n for n in hinted if n.endswith(("k_cache", "v_cache"))]
    if kv_hinted:
        raise ConfigError(f"KV-cache sites cannot be hinted (rows are per KV head, not per token): {kv_hinted[:2]}")
    return SitePlan(tuple(sites), tuple(hinted), fp4_weights=fp4 != "none")
