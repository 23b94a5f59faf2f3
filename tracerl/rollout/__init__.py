"""The rollout side: the reference FP4 rollout engine (batched prefill, token-by-token decode over a static KV
cache, replayed as one CUDA graph per step on a GPU), the recorder that turns its captures into store records, and
the rollout worker of the closed loop (newest policy version in, GRPO groups and results out).

Recording from SGLang lives in `tracerl.sglang`.
"""

from tracerl import deprecation

from tracerl.rollout.decode import StaticDecoder, supports_static_decode
from tracerl.rollout.engine import RolloutEngine, RolloutResult
from tracerl.rollout.recorder import NO_EXPERT, MemorySink, RolloutRecorder, TracePiece, TraceSink
from tracerl.rollout.worker import RolloutWorker, run_rollout

__all__ = ["StaticDecoder", "supports_static_decode", "RolloutEngine", "RolloutResult", "NO_EXPERT", "MemorySink",
           "RolloutRecorder", "TracePiece", "TraceSink", "RolloutWorker", "run_rollout"]

# names that left this package's modules in tracerl 0.2 (`tracerl.deprecation`)
__getattr__ = deprecation.forward(__name__, {
    "CODES_PREFIX": "tracerl.artifacts.codes",
})
