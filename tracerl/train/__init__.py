"""Our own training side: hint-guided QAT recompute of stored trajectories (`QATTrainer`), the follower that
assembles complete GRPO groups from a live store exactly once (`Follower`), the GRPO loss in named parts
(`tracerl.train.loss`), one optimizer step at a time on unsharded or FSDP2-sharded weights (`GRPOTrainer`,
`tracerl.train.params`) and the trainer's main loop with checkpoints and weight publication (`run_training`,
`start_or_resume`). Micro-batch packing and the hint feed that other trainers use are `tracerl.hints`.
"""

from tracerl import deprecation

from tracerl.train.determinism import param_digest, set_deterministic
from tracerl.train.dist import any_rank, barrier, gather_objects, rank_world
from tracerl.train.follower import Follower, Group, Taken, Trajectory
from tracerl.train.grpo import GRPOTrainer
from tracerl.train.loss import entropy_from_logits, group_advantages, policy_loss, token_logprobs
from tracerl.train.recompute import QATTrainer, RecomputeResult, TokenLogprobs
from tracerl.train.run import run_training, start_or_resume

__all__ = [
    "param_digest", "set_deterministic",
    "any_rank", "barrier", "gather_objects", "rank_world",
    "Follower", "Group", "Taken", "Trajectory",
    "GRPOTrainer",
    "entropy_from_logits", "group_advantages", "policy_loss", "token_logprobs",
    "QATTrainer", "RecomputeResult", "TokenLogprobs",
    "run_training", "start_or_resume",
]

# names that left this package's modules in tracerl 0.2 (`tracerl.deprecation`)
__getattr__ = deprecation.forward(__name__, {
    "MetricsLog": "tracerl.runlog",
    "json_ready": "tracerl.runlog",
    "CODES_KEY": "tracerl.artifacts.codes",
})
