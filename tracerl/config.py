"""What tracerl's configuration accepts, importable without torch.

The choices below have their one home here: the modules that act on them (`tracerl.policy`, `tracerl.rollout`,
`tracerl.train`, `tracerl.audit`) import them, and the command line offers and checks them at parse time without
loading torch or transformers: the configurations (`DemoConfig`, `TrainConfig`, `RolloutConfig`, `LoopConfig`,
`AuditConfig`), the model size (`TinyMoESpec`), hinted layers (`parse_layers`) and store URLs (`check_new_store`,
`check_store_exists`). Each ``check`` rejects what cannot run, saying what arrived and what is allowed, before
anything is built.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tracefp4.constants import NVFP4_BLOCK_SIZE
from tracerl.errors import ConfigError

#: set by `tracerl loop` in its children's environment: the loop process's pid (tracerl.cli.args.stop_with_parent)
LOOP_PARENT_ENV = "TRACERL_LOOP_PARENT"

MODEL_FAMILIES = ("qwen3-moe", "qwen3.5-moe")
#: FP4 placement: none, the routed experts' GEMMs (inputs and weights), or also the attention projections
FP4_PLACEMENTS = ("none", "experts", "experts+attention")
#: which FP4 sites of a hinted layer get hints
HINT_SITE_KINDS = ("moe-input", "all-fp4")
#: rollout decode paths of `tracerl.rollout.engine.RolloutEngine`
DECODE_PATHS = ("auto", "hf", "static", "graph")
#: how a store keeps a hinted site's block scales (tracestore FORMAT §2.4, the same list tracestore checks manifests
#: against): E4M3 bytes, or scale hints (one LSB per block)
SCALE_ENCODINGS = ("bytes", "lsb")
#: ``tracerl audit --concurrent-decode``: the replay and floor decodes side by side (auto: CUDA-graph decodes)
CONCURRENT_DECODE = ("auto", "on", "off")


@dataclasses.dataclass(frozen=True)
class TinyMoESpec:
    """Size of a random-init MoE model. Defaults: the demo's tiny model (hidden 256, 8 layers)."""

    family: str = "qwen3-moe"
    hidden_size: int = 256
    num_layers: int = 8
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    num_experts: int = 16
    top_k: int = 2
    moe_intermediate_size: int = 128
    vocab_size: int = 1024
    max_position_embeddings: int = 8192
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        if self.family not in MODEL_FAMILIES:
            raise ConfigError(f"unknown model family {self.family!r}; supported: {', '.join(MODEL_FAMILIES)}")
        for name in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "top_k", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        if not self.top_k <= self.num_experts <= 256:
            raise ConfigError(f"num_experts={self.num_experts}: need top_k ({self.top_k}) <= num_experts <= 256 "
                              "(routed expert ids are stored as uint8)")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.vocab_size < 2:
            raise ConfigError(f"vocab_size={self.vocab_size} must be >= 2")
        for name in ("hidden_size", "moe_intermediate_size"):
            value = getattr(self, name)
            if value < 1 or value % NVFP4_BLOCK_SIZE:
                raise ConfigError(f"{name}={value} must be a positive multiple of {NVFP4_BLOCK_SIZE} (NVFP4 block)")


def parse_layers(spec: str | Sequence[int], num_layers: int) -> list[int]:
    """``latter-half`` | ``all`` | ``none`` | ``"0,3,5"`` | a sequence of ints -> sorted layer indices."""
    if not isinstance(spec, str):
        layers = sorted({int(i) for i in spec})
    elif spec == "latter-half":
        layers = list(range(num_layers // 2, num_layers))
    elif spec == "all":
        layers = list(range(num_layers))
    elif spec in ("none", ""):
        layers = []
    else:
        try:
            layers = sorted({int(tok) for tok in spec.split(",") if tok.strip()})
        except ValueError as e:
            raise ConfigError(
                f"hint layers {spec!r}: expected latter-half, all, none or comma-separated layer indices"
            ) from e
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise ConfigError(f"hint layers {bad} out of range for a model of {num_layers} layers")
    return layers


def check_new_store(url: str, storage_options: Mapping | None = None) -> None:
    """Raise `ConfigError` unless a new store can be created at ``url``: no store there yet and, for a local
    path, nothing or an empty directory there, below a writable directory. A remote URL is asked whether a store
    exists (a storage error raises tracestore's `BackendError`). Creates nothing; loads no torch."""
    exists = ConfigError(f"store {url}: a tracestore store exists there already; the demo creates a new one "
                         "(give a path that does not exist yet)")

    def has_store(where: str) -> bool:
        import tracestore as ts

        try:
            ts.open_store(where, storage_options=storage_options).close()
        except ts.StoreNotFoundError:
            return False
        return True

    if "://" in url and not url.startswith("file://"):
        if has_store(url):
            raise exists
        return
    path = Path(url.removeprefix("file://")).expanduser().absolute()
    if path.is_dir() and any(path.iterdir()):
        if has_store(str(path)):
            raise exists
        raise ConfigError(f"store {url}: a directory with other files in it; give a new or empty directory")
    parent = path
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"store {url}: cannot be created, {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"store {url}: cannot be created, {parent} is not writable")


def check_store_exists(url: str, storage_options: Mapping | None = None) -> None:
    """Raise tracestore's `StoreNotFoundError` (or its `BackendError` when the storage fails) unless a store
    exists at ``url``: opens its manifest and closes it again, without loading torch."""
    import tracestore as ts

    ts.open_store(url, storage_options=storage_options).close()


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
    storage_options: dict | None = None  # of ``store`` (S3 endpoint, credentials)
    scale_encoding: str = "bytes"  # the store's hinted sites (FORMAT §2.4): bytes | lsb (scale hints)

    @property
    def min_tokens(self) -> int:
        """The smallest ``tokens`` that leaves a response of 2 tokens after the longest prompt."""
        return self.prompt_tokens[1] + 2

    def check(self) -> None:
        """Raise `ConfigError` (what arrived, what is allowed) for a configuration the demo cannot run: counts
        below their minimum, a token budget with no room for a response, an unknown choice, a model size
        `TinyMoESpec` rejects, hinted layers the model does not have, a ``store`` that exists already or cannot be
        created (`check_new_store`). Loads no torch; the device is checked where it is used."""
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
        if self.scale_encoding not in SCALE_ENCODINGS:
            raise ConfigError(f"scale_encoding={self.scale_encoding!r}; supported: {', '.join(SCALE_ENCODINGS)}")
        spec = self.model_spec()
        parse_layers(self.hint_layers, spec.num_layers)
        if self.store is not None:
            check_new_store(self.store, self.storage_options)

    def model_spec(self) -> TinyMoESpec:
        """The model size: the family and ``spec``'s overrides of `TinyMoESpec`'s defaults (raises `ConfigError`)."""
        try:
            return TinyMoESpec(family=self.model, **self.spec)
        except TypeError as e:  # an unknown field
            raise ConfigError(f"spec={self.spec!r}: {e}; fields: "
                              f"{', '.join(f.name for f in dataclasses.fields(TinyMoESpec))}") from None


#: why the trainer's follower sets a trajectory aside (never trains on it); the keys are the ``reason`` of
#: `tracerl.train.Follower.set_aside` entries (here, so that the command line lists them without torch)
SET_ASIDE_REASONS: dict[str, str] = {
    "no_group_id": "its result has no group_id (GRPO needs groups)",
    "group_size": "its result declares another group size than the trainer's",
    "tokens": "its token records do not cover [0, n) past the prompt",
    "duplicate_result": "a second result for a trajectory whose result was already taken",
    "group_overfull": "its group already had group_size results",
    "group_incomplete": "its group stayed incomplete while more than max_open_groups groups were open",
    "never_completed": "token records without a result while more than max_pending trajectories were pending",
    "tokens_after_result": "token records committed after the trajectory's result (ignored; the trajectory "
                           "was complete)",
}
#: QAT modes of the trainer (`tracerl.policy.runtime.MODES`): here, so that the command line checks them without torch
QAT_MODES = ("bf16", "fp4_rne_own_scales", "fp4_rne_rollout_scales", "fp4_hints")
#: where margin-exception rows are decoded (`tracerl.hints.compact_device.unpack_sites`, `decode_margin`, `HintFeed`):
#: "auto" (on a CUDA device with the Triton decoder, or the torch codec where Triton is missing; else with numpy on
#: the host), "device" (the torch codec on the device), "host" (numpy), "triton" (one Triton kernel per coding
#: straight into the planes the fill-in reads: CUDA, or TRITON_INTERPRET=1)
MARGIN_DECODES = ("auto", "device", "host", "triton")


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
    micro_batch_tokens: int = 8192
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
    #: measure the mismatch of stale groups too: keep the last ``max_staleness`` versions' bf16 weights (host memory
    #: on a GPU, plus one version's worth for the copy of the current one, made while its step computes) and, after a
    #: step's backwards, run one extra forward (no gradient) per version and micro-batch that holds such groups
    measure_stale: bool = True
    #: keep the weights of every N-th policy version only (versions 0, N, 2N, ...), so that the stale groups of one
    #: version in N are measured: the extra forward costs 40% of an H200 step (a weight swap, re-quantization and a
    #: forward per micro-batch) and is for observing, not for training (the PPO ratio uses the rollout's log-probs);
    #: the others' response tokens are counted as ``unmeasured_tokens``. 1 measures every stale group
    measure_stale_every: int = 4
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
    #: where the micro-batches' margin-exception rows are decoded (`MARGIN_DECODES`)
    margin_decode: str = "auto"

    def check(self) -> None:
        """Raise `ConfigError` (what arrived, what is allowed) for settings the trainer cannot use."""
        if self.mode not in QAT_MODES:
            raise ConfigError(f"mode={self.mode!r}; supported: {', '.join(QAT_MODES)}")
        if self.margin_decode not in MARGIN_DECODES:
            raise ConfigError(f"margin_decode={self.margin_decode!r}; supported: {', '.join(MARGIN_DECODES)}")
        for name, lo in (("groups_per_step", 1), ("group_size", 2), ("micro_batch_tokens", 1), ("max_staleness", 0),
                         ("max_open_groups", 1), ("measure_stale_every", 1), ("checkpoint_every", 0), ("read_ahead_bytes", 0), ("seed", 0)):
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
        """The config of ``to_json``'s output; unknown keys raise `ConfigError`. A config written before
        ``measure_stale_every`` existed measured every stale group: it keeps doing so (1), not the new default."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(obj) - names)
        if unknown:
            raise ConfigError(f"train config: unknown keys {unknown}")
        cfg = cls(**{"measure_stale_every": 1, **obj, "betas": tuple(obj.get("betas", cls.betas))})
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
    #: the store's scale encoding at every site: bytes (E4M3 bytes) or lsb (scale hints, format 4: 0.71x bytes)
    scale_encoding: str = "bytes"
    fp4: str = "experts"
    mode: str = "fp4_hints"
    groups_per_step: int = 16
    group_size: int = 8
    lr: float = 1e-4
    max_staleness: int = 1
    max_ahead: int = 1
    tis_cap: float | None = None
    micro_batch_tokens: int = 8192
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
        if self.scale_encoding not in SCALE_ENCODINGS:
            raise ConfigError(f"scale_encoding={self.scale_encoding!r}; supported: {', '.join(SCALE_ENCODINGS)}")


#: ``tracerl audit --margins``: the scale payloads of a margin point (a marked block's whole E4M3 byte or its LSB)
MARGIN_PAYLOADS = ("byte", "lsb")
#: ``tracerl audit --margin-sites``: the sites the margin passes encode (the store's hinted ones, or every FP4
#: activation site the replay observes)
MARGIN_SITES = ("hinted", "all")
#: the most margin points one audit measures (each is two recompute passes and a mark buffer per site)
MAX_MARGINS = 8


def parse_margins(text: str) -> tuple[tuple[float, float, str], ...]:
    """``"M:MS[:PAYLOAD],..."`` (value margin in ladder steps, scale margin in E4M3 steps, each a number >= 0 or
    ``inf``; payload ``byte`` (default) or ``lsb``) -> ``((m, m_s, payload), ...)``. Raises `ConfigError` naming the
    item that does not parse."""
    out = []
    for item in (t.strip() for t in text.split(",")):
        parts = item.split(":")
        if not item or len(parts) not in (2, 3):
            raise ConfigError(f"margin point {item!r}: expected M:MS or M:MS:PAYLOAD (e.g. 0.03:0.3 or 0.1:inf:lsb)")
        try:
            m, ms = float(parts[0]), float(parts[1])
        except ValueError:
            raise ConfigError(f"margin point {item!r}: M and MS must be numbers >= 0 or inf") from None
        out.append((m, ms, parts[2] if len(parts) == 3 else "byte"))
    return tuple(out)


def margin_name(point: Sequence[Any]) -> str:
    """The pass / JSON name of a margin point: ``m=0.03 ms=0.3`` (``lsb`` appended for scale hints)."""
    m, ms, payload = point
    return f"m={m:g} ms={ms:g}" + (" lsb" if payload == "lsb" else "")


@dataclasses.dataclass
class AuditConfig:
    """What `run_audit` audits and how (the ``tracerl audit`` options)."""

    store: str
    device: str = "auto"  # auto: the device type the rollout ran on when this machine has it, else cpu
    model: str | None = None  # a safetensors checkpoint instead of the store's weights
    max_trajectories: int | None = None  # audit the first N trajectories (by id)
    micro_batch_tokens: int = 8192
    bands: int = 4
    position_bucket: int = 64
    attribution: bool = True
    planner: bool = True
    target_excess: float | None = None
    backend: str = "auto"
    storage_options: dict | None = None
    verify: bool = True
    concurrent_decode: str = "auto"  # replay and floor decodes side by side: CONCURRENT_DECODE (auto: CUDA graphs)
    #: margin points ((m, m_s, payload), `parse_margins`): each one encodes `margin_sites` as margin exceptions from
    #: the replay's activations and recomputes the tokens with the trainer's reconstruction (own routes, and with
    #: routing replay); empty: no margin passes. The marks come from the replay's decode on its recorded path
    margins: tuple = ()
    margin_sites: str = "hinted"
    #: the joint planner over sites x encoding x margin (`tracerl.audit.plan`): per planner unit not hinted, bits, or
    #: margin exceptions at one of ``margins``; needs ``margins`` and ``planner``
    margin_planner: bool = False

    def check(self) -> None:
        """Raise `ConfigError` for values that cannot run (what arrived, what is allowed)."""
        self.margins = tuple(tuple(p) if isinstance(p, (list, tuple)) else p for p in self.margins)
        for p in self.margins:
            ok = (isinstance(p, tuple) and len(p) == 3 and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                                 and v >= 0 for v in p[:2]) and p[2] in MARGIN_PAYLOADS)
            if not ok:  # NaN fails v >= 0
                raise ConfigError(f"margin point {p!r}: must be (m, m_s, payload) with m, m_s numbers >= 0 or inf "
                                  f"and payload one of {', '.join(MARGIN_PAYLOADS)}")
        if len(set(self.margins)) != len(self.margins) or len(self.margins) > MAX_MARGINS:
            raise ConfigError(f"margins: {len(self.margins)} point(s) given; at most {MAX_MARGINS}, each once")
        if self.margin_sites not in MARGIN_SITES:
            raise ConfigError(f"margin_sites={self.margin_sites!r}: must be one of {', '.join(MARGIN_SITES)}")
        for name, lo in (("micro_batch_tokens", 1), ("bands", 1), ("position_bucket", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ConfigError(f"{name}={v!r}: must be an integer >= {lo}")
        if self.max_trajectories is not None and (not isinstance(self.max_trajectories, int)
                                                  or self.max_trajectories < 1):
            raise ConfigError(f"max_trajectories={self.max_trajectories!r}: must be an integer >= 1")
        if self.target_excess is not None and not (isinstance(self.target_excess, (int, float))
                                                   and math.isfinite(self.target_excess)):
            raise ConfigError(f"target_excess={self.target_excess!r}: must be a finite number")
        if self.concurrent_decode not in CONCURRENT_DECODE:
            raise ConfigError(f"concurrent_decode={self.concurrent_decode!r}: must be one of "
                              f"{', '.join(CONCURRENT_DECODE)}")
        if self.target_excess is not None and not self.planner:
            raise ConfigError("target_excess needs the planner (planner=False given)")
        if not isinstance(self.margin_planner, bool):
            raise ConfigError(f"margin_planner={self.margin_planner!r}: must be True or False")
        if self.margin_planner and not self.margins:
            raise ConfigError("margin_planner needs margin points (margins=() given): its options are bits and "
                              "margin exceptions at each of them")
        if self.margin_planner and not self.planner:
            raise ConfigError("margin_planner needs the planner (planner=False given): its units and bits options "
                              "are the planner's")
