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

#: set by `tracerl loop` in its children's environment: the loop process's pid (tracerl.cli.args.stop_with_parent)
LOOP_PARENT_ENV = "TRACERL_LOOP_PARENT"

MODEL_FAMILIES = ("qwen3-moe", "qwen3.5-moe")
#: FP4 placement: none, the routed experts' GEMMs (inputs and weights), or also the attention projections
FP4_PLACEMENTS = ("none", "experts", "experts+attention")
#: which FP4 sites of a hinted layer get hints
HINT_SITE_KINDS = ("moe-input", "all-fp4")
#: rollout decode paths of `tracerl.engine.RolloutEngine`
DECODE_PATHS = ("auto", "hf", "static", "graph")
#: ``tracerl audit --concurrent-decode``: the replay and floor decodes side by side (auto: CUDA-graph decodes)
CONCURRENT_DECODE = ("auto", "on", "off")


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


#: QAT modes of the trainer (`tracerl.qat.MODES`): here, so that the command line checks them without torch
QAT_MODES = ("bf16", "fp4_rne_own_scales", "fp4_rne_rollout_scales", "fp4_hints")


@dataclasses.dataclass
class TrainConfig:
    """Configuration of the GRPO trainer (`tracerl.train`; the ``tracerl train`` command's options).

    One step takes ``groups_per_step`` complete groups of ``group_size`` trajectories each from the store (in
    the order their last result committed), computes group-normalized advantages, and takes one AdamW step on the
    PPO-clip loss (token-mean over the step's response tokens) against the rollout's stored log-probs, or with
    ``tis_cap`` a truncated-importance-sampling weight min(exp(logp_trainer - logp_rollout), tis_cap)."""

    mode: str = "fp4_hints"
    groups_per_step: int = 16
    group_size: int = 8
    micro_batch_tokens: int = 4096
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    clip_low: float = 0.2
    clip_high: float = 0.28
    clip_ratio_c: float | None = None
    adv_scale: str = "std"
    tis_cap: float | None = None
    temperature: float = 1.0
    replay_routes: bool = False
    #: groups whose policy version is older than the trainer's by more than this are dropped (not trained)
    max_staleness: int = 1
    #: the most groups the follower keeps open (incomplete) at once; more means the rollout is misconfigured
    max_open_groups: int = 4096
    #: record the effective codes at hinted sites and compare them with the rollout's (when it recorded them)
    code_agreement: bool = True
    #: measure the mismatch of stale groups too: keep the last ``max_staleness`` versions' bf16 weights and run one
    #: extra forward (no gradient) with the generating version's weights per micro-batch that holds such groups
    measure_stale: bool = True
    #: a step's micro-batches are read from the store ahead of their forward/backward while the batches read and not
    #: yet trained hold at most this many bytes (at least one is always read): a step's batch is in the trainer's
    #: memory as soon as the store delivers it instead of one micro-batch at a time between computations
    read_ahead_bytes: int = 256 << 20
    #: time the phases of a step (forward, backward, mismatch measurement, stale forwards, optimizer, weight
    #: history) in ``phases_s`` of its metrics, waiting for the device at each phase boundary (a few syncs per
    #: micro-batch: for finding where a step's time goes, off by default)
    time_phases: bool = False
    #: commit a checkpoint every N steps; 0 never checkpoints (not even step 0: for throughput runs where a checkpoint
    #: does not fit on the disk; such a trainer cannot resume and refuses to start on a run that already trained)
    checkpoint_every: int = 1
    #: keep this many newest checkpoints (and always the first); None keeps every checkpoint
    keep_checkpoints: int | None = None
    #: keep this many newest published policy versions (and always version 0); None keeps every version
    keep_versions: int | None = None
    seed: int = 0
    deterministic: bool = True

    def check(self) -> None:
        """Raise `ConfigError` (what arrived, what is allowed) for settings the trainer cannot use."""
        if self.mode not in QAT_MODES:
            raise ConfigError(f"mode={self.mode!r}; supported: {', '.join(QAT_MODES)}")
        for name, lo in (("groups_per_step", 1), ("group_size", 2), ("micro_batch_tokens", 1), ("max_staleness", 0),
                         ("max_open_groups", 1), ("checkpoint_every", 0), ("read_ahead_bytes", 0), ("seed", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise ConfigError(f"{name}={value!r}: must be an integer >= {lo}")
        for name in ("keep_checkpoints", "keep_versions"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name}={value!r}: must be an integer >= 1 or None")
        if not self.lr > 0 or not self.grad_clip > 0 or not self.temperature > 0 or self.weight_decay < 0:
            raise ConfigError(f"lr={self.lr}, grad_clip={self.grad_clip}, temperature={self.temperature} must be > 0 "
                              f"and weight_decay={self.weight_decay} >= 0")
        if not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"betas={self.betas}: each must be in [0, 1)")
        if self.clip_low < 0 or self.clip_high < 0:
            raise ConfigError(f"clip_low={self.clip_low}, clip_high={self.clip_high}: must be >= 0")
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1:
            raise ConfigError(f"clip_ratio_c={self.clip_ratio_c}: must be > 1 (or None)")
        if self.tis_cap is not None and not self.tis_cap > 0:
            raise ConfigError(f"tis_cap={self.tis_cap}: must be > 0 (or None)")
        if self.adv_scale not in ("std", "none"):
            raise ConfigError(f"adv_scale={self.adv_scale!r}; supported: std, none")

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "betas": list(self.betas)}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> TrainConfig:
        """The config of ``to_json``'s output; unknown keys raise `ConfigError`."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(obj) - names)
        if unknown:
            raise ConfigError(f"train config: unknown keys {unknown}")
        cfg = cls(**{**obj, "betas": tuple(obj.get("betas", cls.betas))})
        cfg.check()
        return cfg


@dataclasses.dataclass
class RolloutConfig:
    """Configuration of the rollout worker (`tracerl.rollout`; the ``tracerl rollout`` command's options).

    Each generation batch samples ``group_size`` responses to each of ``groups_per_batch`` task prompts with the
    newest published policy version, records them (hints, scales, routed experts, tokens, log-probs, the
    version) and commits each trajectory's result (reward, group, lengths, version)."""

    groups_per_batch: int = 16
    group_size: int = 8
    temperature: float = 1.0
    seed: int = 0
    #: how many batches the worker may be ahead of the trainer, which takes one of its batches per step (1:
    #: on-policy, synchronous; 2: rollout overlaps training, one version behind)
    max_ahead: int = 1
    #: also store the rollout's FP4 codes at the hinted sites (4 bits per value, beside the store under
    #: ``audit/codes/``) so that the trainer can report code agreement; a measurement option
    record_codes: bool = False
    flush_tokens: int = 2048
    decode: str = "auto"
    #: seconds between polls for a newer policy version while waiting
    poll_interval_s: float = 0.1

    def check(self) -> None:
        """Raise `ConfigError` (what arrived, what is allowed) for settings the worker cannot use."""
        for name, lo in (("groups_per_batch", 1), ("group_size", 2), ("seed", 0), ("max_ahead", 1),
                         ("flush_tokens", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise ConfigError(f"{name}={value!r}: must be an integer >= {lo}")
        if not self.temperature > 0 or not self.poll_interval_s > 0:
            raise ConfigError(f"temperature={self.temperature} and poll_interval_s={self.poll_interval_s} must be > 0")
        if self.decode not in DECODE_PATHS:
            raise ConfigError(f"decode={self.decode!r}; supported: {', '.join(DECODE_PATHS)}")


@dataclasses.dataclass
class LoopConfig:
    """Configuration of `tracerl.loop.run_loop` (the ``tracerl loop`` command): one store, one trainer process and
    ``rollouts`` rollout processes, until the policy has ``steps`` updates."""

    run_dir: str
    store: str | None = None  # default: <run_dir>/store
    steps: int = 20
    rollouts: int = 1
    task: dict[str, Any] = dataclasses.field(
        default_factory=lambda: {"name": "target-set", "alphabet": 8, "prompt_len": 3, "response_len": 8})
    spec: dict[str, Any] = dataclasses.field(default_factory=dict)  # TinyMoESpec overrides (vocab: the task's)
    hint_layers: str = "latter-half"
    fp4: str = "experts"
    mode: str = "fp4_hints"
    groups_per_step: int = 16
    group_size: int = 8
    lr: float = 1e-4
    max_staleness: int = 1
    max_ahead: int = 1
    tis_cap: float | None = None
    micro_batch_tokens: int = 4096
    record_codes: bool = True
    seed: int = 0
    rollout_device: str = "cpu"
    trainer_device: str = "cpu"
    threads: int = 1  # torch threads per process
    storage_options: dict[str, Any] | None = None
    extra_train_args: tuple[str, ...] = ()
    extra_rollout_args: tuple[str, ...] = ()

    def check(self) -> None:
        """Raise `ConfigError` for settings the loop cannot run (the trainer's and rollout's are checked there)."""
        for name, lo in (("steps", 1), ("rollouts", 1), ("threads", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise ConfigError(f"{name}={value!r}: must be an integer >= {lo}")
        TrainConfig(mode=self.mode, groups_per_step=self.groups_per_step, group_size=self.group_size, lr=self.lr,
                    max_staleness=self.max_staleness, tis_cap=self.tis_cap,
                    micro_batch_tokens=self.micro_batch_tokens, seed=self.seed).check()
        RolloutConfig(group_size=self.group_size, max_ahead=self.max_ahead, seed=self.seed).check()
        if self.fp4 not in FP4_PLACEMENTS:
            raise ConfigError(f"fp4={self.fp4!r}; supported: {', '.join(FP4_PLACEMENTS)}")
