"""The training side: hint-guided QAT recompute of stored trajectories (`QATTrainer`), packed THD micro-batches
sliced for data, context and tensor parallelism (`pack_micro_batches`, `read_packed`, `dp_shard`, `cp_shard`,
`tp_feature_range`), the follower that assembles complete GRPO groups from a live store exactly once
(`Follower`), the GRPO loss in named parts (`tracerl.train.loss`), one optimizer step at a time (`GRPOTrainer`)
and the trainer's main loop with checkpoints and weight publication (`run_training`, `start_or_resume`).
"""

from tracerl import deprecation

from tracerl.train.determinism import param_digest, set_deterministic
from tracerl.train.dist import any_rank, barrier, gather_objects, rank_world
from tracerl.train.follower import Follower, Group, Taken, Trajectory
from tracerl.train.grpo import GRPOTrainer
from tracerl.train.loss import entropy_from_logits, group_advantages, policy_loss, token_logprobs
from tracerl.train.packing import (
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
from tracerl.train.recompute import QATTrainer, RecomputeResult, TokenLogprobs
from tracerl.train.run import run_training, start_or_resume
from tracerl.train.source import RecordSource, packed_nbytes, read_ahead

__all__ = [
    "param_digest", "set_deterministic",
    "any_rank", "barrier", "gather_objects", "rank_world",
    "Follower", "Group", "Taken", "Trajectory",
    "GRPOTrainer",
    "entropy_from_logits", "group_advantages", "policy_loss", "token_logprobs",
    "MicroBatch", "PackedHints", "Segment", "cp_shard", "cp_zigzag_ranges", "dp_shard", "pack_micro_batches",
    "read_packed", "tp_feature_range",
    "QATTrainer", "RecomputeResult", "TokenLogprobs",
    "run_training", "start_or_resume",
    "RecordSource", "packed_nbytes", "read_ahead",
]

# names that left this package's modules in tracerl 0.2 (`tracerl.deprecation`)
__getattr__ = deprecation.forward(__name__, {
    "MetricsLog": "tracerl.runlog",
    "json_ready": "tracerl.runlog",
    "CODES_KEY": "tracerl.artifacts.codes",
})
