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

from tracerl.decode import StaticDecoder, supports_static_decode
from tracerl.engine import RolloutEngine, RolloutResult
from tracerl.errors import ConfigError, HintMismatchError, RecorderError, TracerlError
from tracerl.models import TinyMoESpec, build_model
from tracerl.packing import (
    MicroBatch,
    PackedHints,
    Segment,
    cp_shard,
    cp_zigzag_ranges,
    dp_shard,
    pack_micro_batches,
    read_packed,
    tp_feature_range,
)
from tracerl.qat import MODES, FP4Runtime, install_fp4
from tracerl.recorder import MemorySink, RolloutRecorder, TraceSink
from tracerl.sites import SitePlan, SiteSpec, plan_sites
from tracerl.trainer import QATTrainer, RecomputeResult

__all__ = [
    "RolloutEngine", "RolloutResult", "StaticDecoder", "supports_static_decode", "RolloutRecorder", "TraceSink", "MemorySink",
    "TinyMoESpec", "build_model", "SitePlan", "SiteSpec", "plan_sites", "FP4Runtime", "install_fp4", "MODES",
    "QATTrainer", "RecomputeResult", "Segment", "MicroBatch", "PackedHints", "pack_micro_batches", "dp_shard",
    "cp_zigzag_ranges", "cp_shard", "tp_feature_range", "read_packed",
    "TracerlError", "ConfigError", "HintMismatchError", "RecorderError",
]
