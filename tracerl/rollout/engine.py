"""Reference FP4 rollout engine: batched prefill + token-by-token decode with a KV cache, seeded sampling.

The model carries an `FP4Runtime` (`tracerl.policy.runtime.install_fp4`); the engine runs it in ``fp4_rne_own_scales``
(the FP4 rollout) or ``bf16`` (the floor run) and, at hinted sites, receives each `tracefp4.quantize` result
through the runtime's capture callback and hands hint bits and block scales to a `RolloutRecorder` along with
the routed expert ids, the sampled tokens and their log-probs. Nothing here synchronizes with the device per
step except what the model's own expert dispatch does; captured payloads stay on the device until the
recorder drains them, and what the result returns (tokens, log-probs, routes, codes) comes to the host in one
transfer at the end of `generate`, whether or not anything is captured, so capture adds no host sync at all.
Host inputs (prompts, masks, positions) go to the device from pinned memory without blocking. By default the
last sampled token is fed through one more forward (``feed_last``) so that every recorded token has its hints,
scales and routed experts; its logits are discarded.

Decode paths (``decode=``): ``static`` and ``graph`` run `tracerl.rollout.decode.StaticDecoder` (a preallocated KV
cache, SDPA over it; ``graph`` replays each step as one CUDA graph, as serving engines decode, with hint
capture written to device rings inside the graph); ``hf`` calls the model's own forward with a `DynamicCache`
(attention through SDPA by default, ``attn_implementation=None`` keeps the model's setting). ``auto`` picks
``graph`` on CUDA, ``static`` on the CPU, and ``hf`` for models with linear attention (Qwen3.5-MoE). The trainer
recompute uses the model's own forward either way, as a trainer's varlen attention differs from a serving
engine's decode kernels; the ``floor`` of the demo measures that gap.

Batches are left-padded; positions are per request (``cumsum(mask) - 1``), so a request's token at position
t sees the same rotary phase as in the trainer's unpadded recompute.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Collection, Sequence

import numpy as np
import torch

from tracerl.config import DECODE_PATHS
from tracerl.errors import ConfigError
from tracerl.policy import FP4Runtime, cache_kwarg, check_mode, fp4_kv_cache, moe_layer_name
from tracerl.rollout.decode import StaticDecoder, margin_marks_at, supports_static_decode
from tracerl.rollout.recorder import RolloutRecorder
from tracerl.util import swapped, sync, to_device, to_host


@dataclasses.dataclass
class RolloutResult:
    request_ids: list[str]
    prompt_lens: list[int]
    sequences: list[np.ndarray]  # per request: prompt + generated token ids, int64 [P_b + G]
    logprobs: list[np.ndarray]  # per request: sampled tokens' log-probs, float32 [G]
    experts: dict[int, list[np.ndarray]]  # layer -> per request uint8 [P_b + fed, top_k]
    codes: dict[str, list[np.ndarray]]  # hinted site -> per request uint8 [P_b + fed, W/2] (keep_codes)
    prefill_s: float
    decode_s: float
    decode_steps: int
    decode_path: str = "hf"  # see `RolloutEngine.decode_path`
    prepare_s: float = 0.0  # tracing / CUDA-graph capture of the decode step (not in decode_s)
    scales: dict[str, list[np.ndarray]] = dataclasses.field(default_factory=dict)  # site -> uint8 [P_b + fed, W/16]
    # (keep_codes: the E4M3 bytes the rollout's quantizer used, also when its store keeps only their LSBs)


@dataclasses.dataclass
class _Batch:
    """One `RolloutEngine.generate` call's requests: left-padded prompts on the device, lengths on the host."""

    rids: list[str]
    plens: list[int]
    ids: torch.Tensor  # int64 [B, Pmax], left-padded
    mask: torch.Tensor  # int64 [B, Pmax]
    plens_t: torch.Tensor  # int64 [B] on the device
    device: torch.device
    path: str  # decode path
    max_new_tokens: int
    n_fed: int  # decode steps fed back through the model (max_new_tokens, or one less without feed_last)

    def __post_init__(self) -> None:
        # the prompt rows' (request, position), in the prefill's row order
        self.prompt_pos = np.concatenate([np.arange(n) for n in self.plens])
        self.prompt_rids = [r for r, n in zip(self.rids, self.plens) for _ in range(n)]


class _Sampler:
    """The next token of each row from the last logits [B, V]: ``forced`` [B, G] (teacher forcing) or a draw
    from softmax(logits / temperature) with ``generator``; with its log-prob (fp32 [B])."""

    def __init__(self, forced: torch.Tensor | None, generator: torch.Generator, temperature: float):
        self.forced, self.generator, self.temperature = forced, generator, temperature

    def __call__(self, logits: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        logp = torch.log_softmax(logits.float() / self.temperature, dim=-1)  # (B, V)
        if self.forced is not None:
            tok = self.forced[:, step]
        else:
            tok = torch.multinomial(logp.exp(), 1, generator=self.generator).squeeze(-1)
        return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


class RolloutEngine:
    """Generates batches with ``model`` (an HF MoE causal LM with an installed `FP4Runtime`).

    Parameters
    ----------
    recorder: where hint bits, scales, routed experts, tokens and log-probs go (None: nothing is recorded).
    record_experts: also record routed expert ids (uint8 [T, top_k] per MoE layer).
    keep_codes: keep the hinted sites' packed codes (uint8 [T, W/2]) and scale bytes (uint8 [T, W/16]) in the
      result (metrics).
    feed_last: feed the last sampled token through one more forward so it has hints and routes too.
    attn_implementation: attention of the ``hf`` path (None keeps the model's).
    collect_routes: keep routed experts in the result even without a recorder.
    decode: ``auto`` | ``hf`` | ``static`` | ``graph`` (see the module docstring and `decode_path`).
    ring: decode steps per capture ring of the static/graph paths.
    margin_capture: record the margin sites of the recorder's store (hint encoding ``margin``), whose
      margin-exception rows are computed from each site's activation: on the ``hf`` path the recorder gets the
      activation (`RolloutRecorder.record_sites` ``x=``), on the static and graph paths the step computes the
      marks at the site's margins into its capture ring (``marks=``). Without it, a recorder with margin sites
      is refused.
    mark_points: (value margin, scale margin) points: the ``tracefp4.margin_marks`` of each captured site of
      ``mark_sites`` (None: every captured site) at each point, computed from its activation on every decode path
      (the static/graph paths in the step, into their ring) and handed to `_deliver_site` as ``marks`` (the
      audit's replay: `tracerl.audit.replay`).
    marks_stream: the static/graph paths compute the marks on a side stream of the step (`StaticDecoder`
      ``marks_stream``; CUDA; off by default: measured slower); False: in the step's stream. The same bits either
      way.
    fuse_marks: the static/graph paths compute a site's marks in its capture kernel when it has one margin point
      (`StaticDecoder` ``fuse_marks``, the default); False: a `margin_marks` launch per site.

    Raises `ConfigError` for an unknown decode path here, and from `generate` for a path the model or device
    cannot run (``graph`` off CUDA, ``static``/``graph`` with linear attention) and for a recorder with margin
    sites without ``margin_capture``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        runtime: FP4Runtime,
        *,
        recorder: RolloutRecorder | None = None,
        record_experts: bool = True,
        keep_codes: bool = False,
        feed_last: bool = True,
        attn_implementation: str | None = "sdpa",
        collect_routes: bool = True,
        decode: str = "auto",
        ring: int = 32,
        margin_capture: bool = False,
        mark_points: Sequence[tuple[float, float]] = (),
        mark_sites: Collection[str] | None = None,
        marks_stream: bool = False,
        fuse_marks: bool = True,
    ):
        if decode not in DECODE_PATHS:
            raise ConfigError(f"unknown decode path {decode!r}; supported: {', '.join(DECODE_PATHS)}")
        self.model = model
        self.runtime = runtime
        self.recorder = recorder
        self.record_experts = record_experts
        self.keep_codes = keep_codes
        self.feed_last = feed_last
        self.attn_implementation = attn_implementation
        self.collect_routes = collect_routes
        self.decode = decode
        self.ring = ring
        self.margin_capture = bool(margin_capture)
        self.mark_points = [(float(m), float(ms)) for m, ms in mark_points]
        self.mark_sites = None if mark_sites is None else frozenset(mark_sites)
        self.marks_stream = bool(marks_stream)
        self.fuse_marks = bool(fuse_marks)
        self._x: dict[str, torch.Tensor] = {}  # site -> the activation of the current forward (margin_capture)
        self._cache_kw = cache_kwarg(model)
        self._rows: tuple[list[str], np.ndarray, torch.Tensor] | None = None
        self._codes: dict[str, list] = {}
        self._scales: dict[str, list] = {}
        self._experts: dict[int, list] = {}

    # Callbacks from the runtime: rows of the current forward -> (request ids, positions).
    def _on_capture(self, site: str, q) -> None:
        rids, pos, rows = self._rows
        pick = (lambda t: t) if rows is None else (lambda t: t.index_select(0, rows))
        x = self._x.pop(site, None)
        hints, scales = pick(q.hints), pick(q.scales)
        extra = {}
        if x is not None:
            x = pick(x)
            if self.margin_capture:  # x only with margin_capture, marks only at mark_points' sites
                extra["x"] = x
            points = self._extra_points(site)
            if points:
                extra["marks"] = margin_marks_at(self.runtime, site, x, scales, hints, points)
        self._deliver_site(rids, pos, site, hints, scales, pick(q.codes) if self.keep_codes else None, **extra)

    def _stash_x(self, site: str, x: torch.Tensor) -> None:
        """``capture_into`` of the runtime (margin_capture): keep the activation its capture of ``site`` is of; no
        output buffers (None)."""
        self._x[site] = x
        return None

    def _on_route(self, layer: int, idx: torch.Tensor) -> None:
        rids, pos, rows = self._rows
        self._deliver_route(rids, pos, layer, (idx if rows is None else idx.index_select(0, rows)).to(torch.uint8))

    def _recorder_points(self, site: str) -> list[tuple[float, float]]:
        """[(margin, scale margin)] of ``site`` when the recorder keeps it as a margin site (with
        ``margin_capture``), else []."""
        msite = (getattr(self.recorder, "margin_sites", None) or {}).get(site) if self.margin_capture else None
        return [(float(msite.margin), float(msite.scale_margin))] if msite is not None else []

    def _extra_points(self, site: str) -> list[tuple[float, float]]:
        """``mark_points`` at a site of ``mark_sites``, else []."""
        return self.mark_points if self.mark_sites is None or site in self.mark_sites else []

    def _ring_points(self, site: str) -> list[tuple[float, float]]:
        """The margin points the static/graph step computes marks at for ``site``: the recorder's first, then
        ``mark_points``'."""
        return self._recorder_points(site) + self._extra_points(site)

    def _deliver_site(self, rids, pos, site: str, hints, scales, codes, x=None, marks=None,
                      recorder_marks=None) -> None:
        if self.recorder is not None:
            if recorder_marks is not None:
                self.recorder.record_sites(rids, pos, site, hints, scales, marks=recorder_marks)
            elif x is not None and site in self.recorder.margin_sites:
                self.recorder.record_sites(rids, pos, site, hints, scales, x=x,
                                           global_scale=self.runtime.global_scale_on(site, x.device))
            else:
                self.recorder.record_sites(rids, pos, site, hints, scales)
        if self.keep_codes:
            self._codes.setdefault(site, []).append((rids, pos, codes))
            self._scales.setdefault(site, []).append((rids, pos, scales))

    def _deliver_route(self, rids, pos, layer: int, ids: torch.Tensor) -> None:
        name = moe_layer_name(layer)
        if self.recorder is not None and self.record_experts and name in self.recorder.moe_layers:
            self.recorder.record_experts(rids, pos, name, ids)
        self._experts.setdefault(layer, []).append((rids, pos, ids))

    def _take_ring(self, dec: StaticDecoder, window: list[np.ndarray], rids: list[str]) -> None:
        """Hand the decoder's ring (``len(window)`` steps) to the recorder and the result's parts."""
        n = len(window)
        prid, ppos = rids * n, np.concatenate(window)  # ring row = step * B + batch row
        for (kind, name), bufs in dec.take(n).items():
            if kind == "site":
                rest = bufs[3 if self.keep_codes else 2:]  # the margin marks of `_ring_points`, in pairs
                pairs = list(zip(rest[0::2], rest[1::2]))
                extra = {}
                if self._recorder_points(name):  # the recorder's margin site: its own marks first
                    extra["recorder_marks"] = pairs.pop(0)
                if pairs:
                    extra["marks"] = pairs
                self._deliver_site(prid, ppos, name, bufs[0], bufs[1], bufs[2] if self.keep_codes else None, **extra)
            else:
                self._deliver_route(prid, ppos, int(name), bufs[0])

    def decode_path(self, device: torch.device) -> str:
        """The decode path ``generate`` takes on ``device``: ``hf`` (the model's own forward with a
        `DynamicCache`), ``static`` (`StaticDecoder`, eager) or ``graph`` (`StaticDecoder` as a CUDA graph).
        ``auto`` picks ``graph`` on CUDA and ``static`` elsewhere for models the static decoder supports (full
        attention: qwen3-moe), else ``hf`` (Qwen3.5-MoE's linear attention)."""
        if self.decode == "auto":
            if not supports_static_decode(self.model):
                return "hf"
            return "graph" if device.type == "cuda" else "static"
        if self.decode != "hf" and not supports_static_decode(self.model):
            raise ConfigError(f"decode={self.decode!r} needs a full-attention model (qwen3-moe); use 'hf'")
        if self.decode == "graph" and device.type != "cuda":
            raise ConfigError(f"decode='graph' needs a CUDA device, the model is on {device}")
        return self.decode

    def _left_pad(self, prompts, device):
        plens = [len(p) for p in prompts]
        pmax = max(plens)
        ids = torch.zeros(len(prompts), pmax, dtype=torch.long)
        mask = torch.zeros(len(prompts), pmax, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, pmax - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
            mask[b, pmax - len(p) :] = 1
        return plens, to_device(ids, device), to_device(mask, device)

    @torch.no_grad()
    def calibrate(self, prompts: Sequence[Sequence[int]]) -> dict[str, float]:
        """Static per-site global scales from one bf16 prefill of ``prompts`` (`FP4Runtime.calibrating`)."""
        device = next(self.model.parameters()).device
        _, ids, mask = self._left_pad(prompts, device)
        kv = fp4_kv_cache(self.model, self.runtime)
        extra = {} if kv is None else {"use_cache": True, self._cache_kw: kv}
        with self.runtime.calibrating():
            self.model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                       logits_to_keep=1, **({"use_cache": False} | extra))
        return self.runtime.global_scales_json()

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        seed: int = 0,
        temperature: float = 1.0,
        request_ids: Sequence[str] | None = None,
        forced_tokens: torch.Tensor | None = None,
        policy_version: int = 0,
        mode: str = "fp4_rne_own_scales",
        on_step: Callable[[int, int], None] | None = None,
        on_ready: Callable[[], None] | None = None,
    ) -> RolloutResult:
        """Sample ``max_new_tokens`` per prompt; ``forced_tokens`` [B, G] replaces sampling (teacher forcing).

        ``on_step(done, total)`` is called on the host after each of the ``max_new_tokens`` sampling steps
        (progress display; it reads nothing from the device). ``on_ready()`` is called once the decode step is
        prepared (graph captured) and the prompts are prefilled, before the first decode step (the audit lines
        up two decodes there). Raises `ConfigError` for a decode path or mode that cannot run, before anything
        is recorded or changed."""
        device = next(self.model.parameters()).device
        path = self.decode_path(device)
        check_mode(mode)
        margin = sorted(getattr(self.recorder, "margin_sites", None) or ())
        if margin and not self.margin_capture:
            raise ConfigError(f"the recorder's store declares margin sites {margin[:4]} (hint encoding margin): "
                              f"their rows are computed from the activations; pass margin_capture=True")
        b = self._batch(prompts, request_ids, device, path, max_new_tokens)
        forced = None if forced_tokens is None else to_device(torch.as_tensor(forced_tokens), device)  # once
        sample = _Sampler(forced, torch.Generator(device=device).manual_seed(seed), temperature)
        capture = self.recorder is not None or self.keep_codes
        attn = {} if self.attn_implementation is None else {"_attn_implementation": self.attn_implementation}
        self._codes, self._scales, self._experts = {}, {}, {}
        self._begin_records(b, prompts, policy_version)
        with swapped(self.model.config, **attn), swapped(self, _rows=None), self.runtime.using(
            mode=mode,
            capture=self._on_capture if capture else None,
            capture_into=self._stash_x if capture and (self.margin_capture or self.mark_points) else None,
            on_route=self._on_route if capture or self.collect_routes else None,
        ):
            tp = time.perf_counter()
            dec = self._static_decoder(b)
            t0 = time.perf_counter()
            logits, cache = self._prefill(b, dec)
            if on_ready is not None:
                on_ready()
            t1 = time.perf_counter()
            toks, lps = self._decode(b, logits, cache, dec, sample, on_step)
            t2 = time.perf_counter()
            if self.recorder is not None:
                for r in b.rids:
                    self.recorder.end(r)
        return self._result(b, prompts, toks, lps, prefill_s=t1 - t0, decode_s=t2 - t1, prepare_s=t0 - tp)

    def _batch(self, prompts, request_ids, device, path: str, max_new_tokens: int) -> _Batch:
        plens, ids, mask = self._left_pad(prompts, device)
        rids = list(request_ids) if request_ids is not None else [f"req-{i}" for i in range(len(prompts))]
        n_fed = max_new_tokens if self.feed_last else max(max_new_tokens - 1, 0)
        return _Batch(rids, plens, ids, mask, to_device(torch.tensor(plens), device), device, path, max_new_tokens,
                      n_fed)

    def _begin_records(self, b: _Batch, prompts, policy_version: int) -> None:
        """Begin every request in the recorder and hand it the prompt tokens (host rows, NaN log-probs)."""
        rec = self.recorder
        if rec is None:
            return
        for r in b.rids:
            rec.begin(r, policy_version)
        rec.record_tokens(b.prompt_rids, b.prompt_pos,
                          torch.cat([torch.as_tensor(list(p), dtype=torch.long) for p in prompts]),
                          torch.full((len(b.prompt_pos),), float("nan")))

    def _static_decoder(self, b: _Batch) -> StaticDecoder | None:
        """The prepared (traced / graph-captured) `StaticDecoder` of the static and graph paths; None for hf."""
        if b.path == "hf" or b.n_fed == 0:
            return None
        rt = self.runtime
        dec = StaticDecoder(self.model, rt, batch=len(b.rids), max_len=b.ids.shape[1] + b.n_fed, ring=self.ring,
                            capture=rt.capture is not None, keep_codes=self.keep_codes,
                            routes=rt.on_route is not None, use_graph=b.path == "graph", marks=self._ring_points,
                            marks_stream=self.marks_stream, fuse_marks=self.fuse_marks)
        dec.prepare()
        return dec

    def _prefill(self, b: _Batch, dec: StaticDecoder | None):
        """The prompts' forward over the left-padded batch: last logits (B, V) and the `DynamicCache` that the
        hf path decodes with (None when the static decoder holds the prompt's K/V)."""
        from transformers import DynamicCache

        cache = fp4_kv_cache(self.model, self.runtime) or DynamicCache(config=self.model.config)
        # Valid rows of the flattened [B, Pmax] batch, from the host lengths (``mask.nonzero()`` would read the
        # device mask: a host sync).
        pmax = b.ids.shape[1]
        valid = np.concatenate([i * pmax + np.arange(pmax - n, pmax) for i, n in enumerate(b.plens)])
        self._rows = (b.prompt_rids, b.prompt_pos, to_device(torch.as_tensor(valid), b.device))
        out = self.model(input_ids=b.ids, attention_mask=b.mask, position_ids=(b.mask.cumsum(-1) - 1).clamp(min=0),
                         use_cache=True, logits_to_keep=1, **{self._cache_kw: cache})
        if self.recorder is not None:
            self.recorder.step()
        if dec is not None:
            dec.load_prefill(cache, b.mask, b.plens_t)
            cache = None  # the static cache holds the prompt now
        sync(b.device)
        return out.logits[:, -1, :], cache

    def _decode(self, b: _Batch, logits, cache, dec: StaticDecoder | None, sample: _Sampler, on_step):
        """Sample (or take the forced token), record, feed back: per step one token [B] and its log-prob [B]."""
        rec = self.recorder
        mask = b.mask
        toks, lps = [], []
        window: list[np.ndarray] = []  # positions of the steps in the decoder's ring
        for step in range(b.max_new_tokens):
            tok, lp = sample(logits, step)
            toks.append(tok)
            lps.append(lp)
            positions = np.asarray(b.plens) + step
            if rec is not None:
                rec.record_tokens(b.rids, positions, tok, lp)
            if step < b.n_fed and dec is not None:
                logits = dec.step(tok)
                window.append(positions)
                if len(window) == dec.ring:
                    self._take_ring(dec, window, b.rids)
                    window = []
            elif step < b.n_fed:
                mask = torch.cat([mask, torch.ones(len(b.rids), 1, dtype=mask.dtype, device=b.device)], dim=-1)
                self._rows = (b.rids, positions, None)  # decode: every batch row is a request's token
                out = self.model(input_ids=tok[:, None], attention_mask=mask,
                                 position_ids=(b.plens_t + step)[:, None], use_cache=True, **{self._cache_kw: cache})
                logits = out.logits[:, -1, :]
            if rec is not None and step < b.n_fed:
                rec.step()
            if on_step is not None:
                on_step(step + 1, b.max_new_tokens)
        if window:
            self._take_ring(dec, window, b.rids)
        sync(b.device)
        return toks, lps

    def _result(self, b: _Batch, prompts, toks, lps, **seconds: float) -> RolloutResult:
        """Tokens, log-probs, routes and codes to the host in one transfer per device (per-part copies were a
        host sync per MoE layer per forward: the whole cost of capture in the sync check)."""
        bsz = len(b.rids)
        expert_parts = list(self._experts.items())
        code_parts = list(self._codes.items())
        scale_parts = list(self._scales.items())
        dev = [torch.stack(toks, dim=1) if toks else torch.zeros(bsz, 0, dtype=torch.long),
               torch.stack(lps, dim=1) if lps else torch.zeros(bsz, 0)]
        for _, parts in expert_parts + code_parts + scale_parts:
            dev.extend(val for _, _, val in parts)
        host = iter(to_host(dev))
        gen_toks, gen_lps = next(host), next(host)  # (B, G) each

        def assemble(parts):
            return self._assemble([(r, p, next(host)) for r, p, _ in parts], b.rids, b.plens, b.n_fed)

        return RolloutResult(
            request_ids=b.rids,
            prompt_lens=b.plens,
            sequences=[np.concatenate([np.asarray(p, dtype=np.int64), gen_toks[i]]) for i, p in enumerate(prompts)],
            logprobs=[gen_lps[i].astype(np.float32) for i in range(bsz)],
            experts={la: assemble(parts) for la, parts in expert_parts},
            codes={s: assemble(parts) for s, parts in code_parts},
            scales={s: assemble(parts) for s, parts in scale_parts},
            decode_steps=b.n_fed,
            decode_path=b.path,
            **seconds,
        )

    @staticmethod
    def _assemble(parts, rids, plens, gen) -> list[np.ndarray]:
        """Per-step captures (host arrays) -> per request arrays over the fed positions [0, P_b + fed)."""
        index = {r: i for i, r in enumerate(rids)}
        width = tuple(parts[0][2].shape[1:])
        dense = np.zeros((len(rids), max(plens) + gen, *width), dtype=np.uint8)
        for prid, ppos, val in parts:
            b = np.fromiter((index[r] for r in prid), dtype=np.int64, count=len(prid))
            dense[b, np.asarray(ppos)] = val
        return [dense[i, : plens[i] + gen] for i in range(len(rids))]
