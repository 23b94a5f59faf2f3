"""tracerl: the RL side of TRACE — rollout capture and hint-guided QAT for Hugging Face MoE models.

Rollout side::

    model = build_model(TinyMoESpec(), seed=0)                 # tiny random-init Qwen3-MoE (or Qwen3.5-MoE)
    plan = plan_sites(model, hint_layers="latter-half")        # FP4 sites + the hinted subset
    runtime = install_fp4(model, plan)                         # NVFP4 fake quantization at those sites
    engine = RolloutEngine(model, runtime, recorder=RolloutRecorder(writer, widths, ...))
    engine.calibrate(prompts); result = engine.generate(prompts, max_new_tokens, seed=0)

The engine decodes over a static KV cache (`tracerl.decode.StaticDecoder`), replayed as one CUDA graph per step
on a GPU, as serving engines do; hint capture writes device ring buffers inside the graph (no host sync).

Trainer side::

    packed = read_packed(store.reader(), micro_batch, sites, read_kwargs={"fmt": "numpy"})
    QATTrainer(model, runtime).recompute(packed, "fp4_hints", backward=True)

`tracerl.demo.run_demo` wires both ends to a tracestore store and computes `tracerl.fidelity` metrics; the
``tracerl demo`` command prints them.
"""

import importlib
from typing import Any

# Public names -> the module that defines them. They are imported on first use (PEP 562), so that
# ``import tracerl.cli`` (and ``tracerl --help``) does not load torch and transformers.
_EXPORTS = {
    "tracerl.decode": ("StaticDecoder", "supports_static_decode"),
    "tracerl.engine": ("RolloutEngine", "RolloutResult"),
    "tracerl.errors": ("ConfigError", "HintMismatchError", "RecorderError", "TracerlError"),
    "tracerl.models": ("TinyMoESpec", "build_model"),
    "tracerl.packing": ("MicroBatch", "PackedHints", "Segment", "cp_shard", "cp_zigzag_ranges", "dp_shard",
                        "pack_micro_batches", "read_packed", "tp_feature_range"),
    "tracerl.qat": ("MODES", "FP4Runtime", "install_fp4"),
    "tracerl.recorder": ("MemorySink", "RolloutRecorder", "TraceSink"),
    "tracerl.sites": ("SitePlan", "SiteSpec", "plan_sites"),
    "tracerl.trainer": ("QATTrainer", "RecomputeResult"),
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
