"""What tracerl's configuration accepts, importable without torch.

The choices below have their one home here: the modules that act on them (`tracerl.models`, `tracerl.sites`,
`tracerl.engine`) import them, and the command line offers and checks them at parse time without loading
torch or transformers. `DemoConfig` is the demo's configuration; `DemoConfig.check` rejects what cannot run
before anything is built.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tracerl.errors import ConfigError

MODEL_FAMILIES = ("qwen3-moe", "qwen3.5-moe")
#: FP4 placement: none, the routed experts' GEMMs (inputs and weights), or also the attention projections
FP4_PLACEMENTS = ("none", "experts", "experts+attention")
#: which FP4 sites of a hinted layer get hints
HINT_SITE_KINDS = ("moe-input", "all-fp4")
#: rollout decode paths of `tracerl.engine.RolloutEngine`
DECODE_PATHS = ("auto", "hf", "static", "graph")


@dataclasses.dataclass
class DemoConfig:
    """Configuration of `tracerl.demo.run_demo` (the ``tracerl demo`` command's options)."""

    model: str = "qwen3-moe"
    trajectories: int = 16
    tokens: int = 256  # per trajectory, prompt + response
    prompt_tokens: tuple[int, int] = (8, 16)  # prompt lengths drawn uniformly from [lo, hi]
    hint_layers: str = "latter-half"
    hint_sites: str = "moe-input"
    fp4: str = "experts"
    kv_fp4: bool = False
    seed: int = 0
    store: str | None = None
    backward: bool = False
    micro_batch_tokens: int = 8192
    flush_tokens: int = 128
    device: str = "cpu"
    backend: str = "auto"
    decode: str = "auto"  # RolloutEngine decode path: auto | hf | static | graph
    replay_routes: bool = False  # trainer uses the rollout's routed experts (the floor: the floor run's)
    spec: dict[str, Any] = dataclasses.field(default_factory=dict)  # TinyMoESpec overrides

    @property
    def min_tokens(self) -> int:
        """The smallest ``tokens`` that leaves a response of 2 tokens after the longest prompt."""
        return self.prompt_tokens[1] + 2

    def check(self) -> None:
        """Raise `ConfigError` (what arrived, what is allowed) for a configuration the demo cannot run: counts
        below their minimum, a token budget with no room for a response, an unknown choice. The model size
        (``spec``) is checked by `tracerl.models.TinyMoESpec`, the device and hinted layers where they are used."""
        for name, lo in (("trajectories", 1), ("micro_batch_tokens", 1), ("flush_tokens", 1), ("seed", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < lo:
                raise ConfigError(f"{name}={value!r}: must be an integer >= {lo}")
        lo, hi = self.prompt_tokens
        if not 1 <= lo <= hi:
            raise ConfigError(f"prompt_tokens={self.prompt_tokens}: need 1 <= lo <= hi")
        if self.tokens < self.min_tokens:
            raise ConfigError(f"tokens={self.tokens} leaves no room for a response after prompts of up to {hi} "
                              f"tokens; use tokens >= {self.min_tokens}")
        for name, allowed in (("model", MODEL_FAMILIES), ("hint_sites", HINT_SITE_KINDS), ("fp4", FP4_PLACEMENTS),
                              ("decode", DECODE_PATHS)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name}={getattr(self, name)!r}; supported: {', '.join(allowed)}")
