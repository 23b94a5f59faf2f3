"""What tracerl's configuration accepts, importable without torch.

The choices below have their one home here: the modules that act on them (`tracerl.models`, `tracerl.sites`,
`tracerl.engine`) import them, and the command line can offer and check them without loading torch.
"""

from __future__ import annotations

MODEL_FAMILIES = ("qwen3-moe", "qwen3.5-moe")
#: FP4 placement: none, the routed experts' GEMMs (inputs and weights), or also the attention projections
FP4_PLACEMENTS = ("none", "experts", "experts+attention")
#: which FP4 sites of a hinted layer get hints
HINT_SITE_KINDS = ("moe-input", "all-fp4")
#: rollout decode paths of `tracerl.engine.RolloutEngine`
DECODE_PATHS = ("auto", "hf", "static", "graph")

