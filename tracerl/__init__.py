"""tracerl: the RL side of TRACE — rollout capture and hint-guided QAT for Hugging Face MoE models.

The package is laid out along the closed loop:

| sub-package | what |
| --- | --- |
| `tracerl.policy` | the model both ends run: tiny HF MoE builders, FP4 sites, the FP4 runtime, expert GEMMs, tasks |
| `tracerl.rollout` | the reference FP4 rollout engine, static/CUDA-graph decode, recorder, rollout worker |
| `tracerl.sglang` | recording from SGLang servers (an entry-point plugin) |
| `tracerl.hints` | TRACE in any trainer: the hint feed (packed, sliced, read ahead), the model patcher |
| `tracerl.train` | our trainer: QAT recompute, the follower, the GRPO loss and step (FSDP2), the trainer loop |
| `tracerl.artifacts` | policy versions, checkpoints and recorded codes beside a store |
| `tracerl.audit` | ``tracerl audit``: replay, recompute in every mode, attribution, coverage planner |
| `tracerl.loop` | the closed loop's store and processes, replay of training |
| `tracerl.cli` | the ``tracerl`` command |

Rollout side::

    model = build_model(TinyMoESpec(), seed=0)                 # tiny random-init Qwen3-MoE (or Qwen3.5-MoE)
    plan = plan_sites(model, hint_layers="latter-half")        # FP4 sites + the hinted subset
    runtime = install_fp4(model, plan)                         # NVFP4 fake quantization at those sites
    engine = RolloutEngine(model, runtime, recorder=RolloutRecorder(writer, widths, ...))
    engine.calibrate(prompts); result = engine.generate(prompts, max_new_tokens, seed=0)

Trainer side::

    packed = read_packed(store.reader(), micro_batch, sites, read_kwargs={"fmt": "numpy"})
    QATTrainer(model, runtime).recompute(packed, "fp4_hints", backward=True)

`tracerl.demo.run_demo` wires both ends to a tracestore store and computes `tracerl.fidelity` metrics; the
``tracerl demo`` command prints them. The flat module paths of tracerl 0.1 (``tracerl.policy.runtime``, ...) still import,
with a deprecation warning (`tracerl.deprecation`).
"""

import importlib
from typing import Any

from tracerl import deprecation

deprecation.install()

# Public names -> the package that defines them. They are imported on first use (PEP 562), so that
# ``import tracerl.cli`` (and ``tracerl --help``) does not load torch and transformers.
_EXPORTS = {
    "tracerl.errors": ("ConfigError", "HintMismatchError", "RecorderError", "TracerlError"),
    "tracerl.policy": ("MODES", "FP4Runtime", "SitePlan", "SiteSpec", "TinyMoESpec", "build_model", "install_fp4",
                       "plan_sites"),
    "tracerl.rollout": ("MemorySink", "RolloutEngine", "RolloutRecorder", "RolloutResult", "StaticDecoder",
                        "TraceSink", "supports_static_decode"),
    "tracerl.hints": ("MicroBatch", "PackedHints", "Segment", "cp_shard", "cp_zigzag_ranges", "dp_shard",
                      "pack_micro_batches", "read_packed", "tp_feature_range", "HintFeed", "FeedBatch", "patch_model"),
    "tracerl.train": ("QATTrainer", "RecomputeResult"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'tracerl' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
