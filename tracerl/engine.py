"""Reference FP4 rollout engine: batched prefill + token-by-token decode with a KV cache, seeded sampling.

The model carries an `FP4Runtime` (`tracerl.qat.install_fp4`); the engine runs it in ``fp4_rne_own_scales``
(the FP4 rollout) or ``bf16`` (the floor run) and, at hinted sites, receives each `tracefp4.quantize` result
through the runtime's capture callback and hands hint bits and block scales to a `RolloutRecorder` along with
the routed expert ids, the sampled tokens and their log-probs. Nothing here synchronizes with the device per
step except what the model's own expert dispatch does; captured payloads stay on the device until the
recorder drains them, and what the result returns (tokens, log-probs, routes, codes) comes to the host in one
transfer at the end of `generate`, whether or not anything is captured, so capture adds no host sync at all.
Host inputs (prompts, masks, positions) go to the device from pinned memory without blocking. By default the
last sampled token is fed through one more forward (``feed_last``) so that every recorded token has its hints,
scales and routed experts; its logits are discarded.

Decode paths (``decode=``): ``static`` and ``graph`` run `tracerl.decode.StaticDecoder` (a preallocated KV
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
import inspect
import time
from collections.abc import Sequence

import numpy as np
import torch

from tracerl.decode import StaticDecoder, supports_static_decode
from tracerl.errors import ConfigError
from tracerl.qat import FP4Runtime, fp4_kv_cache
from tracerl.recorder import RolloutRecorder

DECODE_PATHS = ("auto", "hf", "static", "graph")


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


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor -> ``device`` without a host sync (``t.to(cuda)`` from pageable memory blocks the host)."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


_NP_DTYPES = {torch.uint8: np.uint8, torch.int8: np.int8, torch.int16: np.int16, torch.int32: np.int32,
              torch.int64: np.int64, torch.float16: np.float16, torch.float32: np.float32,
              torch.float64: np.float64, torch.bool: np.bool_}


def _to_host(tensors: Sequence[torch.Tensor]) -> list[np.ndarray]:
    """numpy copies of ``tensors`` (numpy dtypes only) with one device-to-host transfer per device.

    Each device's tensors are concatenated as raw bytes on the device, copied once and split on the host, so
    the values are bit for bit the tensors' (a ``.cpu()`` per tensor would be a blocking copy, a host sync,
    each). Host tensors take the same path, so a CPU run reads values exactly as often as a CUDA run."""
    out: list[np.ndarray | None] = [None] * len(tensors)
    by_dev: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dev.setdefault(t.device, []).append(i)
    for idx in by_dev.values():
        idx.sort(key=lambda i: -tensors[i].element_size())  # keeps every part's byte offset aligned
        flat = [tensors[i].contiguous().reshape(-1).view(torch.uint8) for i in idx]
        host = torch.cat(flat).cpu().numpy()
        off = 0
        for i, f in zip(idx, flat):
            t = tensors[i]
            n = f.shape[0]
            out[i] = host[off : off + n].view(_NP_DTYPES[t.dtype]).reshape(tuple(t.shape))
            off += n
    return out


def _cache_kwarg(model: torch.nn.Module) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class RolloutEngine:
    """Generates batches with ``model`` (an HF MoE causal LM with an installed `FP4Runtime`).

    Parameters
    ----------
    recorder: where hint bits, scales, routed experts, tokens and log-probs go (None: nothing is recorded).
    record_experts: also record routed expert ids (uint8 [T, top_k] per MoE layer).
    keep_codes: keep the hinted sites' packed codes (uint8 [T, W/2]) in the result (metrics).
    feed_last: feed the last sampled token through one more forward so it has hints and routes too.
    attn_implementation: attention of the ``hf`` path (None keeps the model's).
    collect_routes: keep routed experts in the result even without a recorder.
    decode: ``auto`` | ``hf`` | ``static`` | ``graph`` (see the module docstring and `decode_path`).
    ring: decode steps per capture ring of the static/graph paths.

    Raises `ConfigError` for an unknown decode path here, and from `generate` for a path the model or device
    cannot run (``graph`` off CUDA, ``static``/``graph`` with linear attention).
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
        self._cache_kw = _cache_kwarg(model)
        self._rows: tuple[list[str], np.ndarray, torch.Tensor] | None = None
        self._codes: dict[str, list] = {}
        self._experts: dict[int, list] = {}

    # Callbacks from the runtime: rows of the current forward -> (request ids, positions).
    def _on_capture(self, site: str, q) -> None:
        rids, pos, rows = self._rows
        pick = (lambda t: t) if rows is None else (lambda t: t.index_select(0, rows))
        self._deliver_site(rids, pos, site, pick(q.hints), pick(q.scales), pick(q.codes) if self.keep_codes else None)

    def _on_route(self, layer: int, idx: torch.Tensor) -> None:
        rids, pos, rows = self._rows
        self._deliver_route(rids, pos, layer, (idx if rows is None else idx.index_select(0, rows)).to(torch.uint8))

    def _deliver_site(self, rids, pos, site: str, hints, scales, codes) -> None:
        if self.recorder is not None:
            self.recorder.record_sites(rids, pos, site, hints, scales)
        if self.keep_codes:
            self._codes.setdefault(site, []).append((rids, pos, codes))

    def _deliver_route(self, rids, pos, layer: int, ids: torch.Tensor) -> None:
        name = f"model.layers.{layer}.mlp"
        if self.recorder is not None and self.record_experts and name in self.recorder.moe_layers:
            self.recorder.record_experts(rids, pos, name, ids)
        self._experts.setdefault(layer, []).append((rids, pos, ids))

    def _take_ring(self, dec: StaticDecoder, window: list[np.ndarray], rids: list[str]) -> None:
        """Hand the decoder's ring (``len(window)`` steps) to the recorder and the result's parts."""
        n = len(window)
        prid, ppos = rids * n, np.concatenate(window)  # ring row = step * B + batch row
        for (kind, name), bufs in dec.take(n).items():
            if kind == "site":
                self._deliver_site(prid, ppos, name, bufs[0], bufs[1], bufs[2] if self.keep_codes else None)
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
        return plens, _to_device(ids, device), _to_device(mask, device)

    @torch.no_grad()
    def calibrate(self, prompts: Sequence[Sequence[int]]) -> dict[str, float]:
        """Static per-site global scales from one bf16 prefill of ``prompts``: g = amax / (448 * 6)."""
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
    ) -> RolloutResult:
        """Sample ``max_new_tokens`` per prompt; ``forced_tokens`` [B, G] replaces sampling (teacher forcing)."""
        model, rt = self.model, self.runtime
        device = next(model.parameters()).device
        bsz = len(prompts)
        rids = list(request_ids) if request_ids is not None else [f"req-{i}" for i in range(bsz)]
        plens, ids, mask = self._left_pad(prompts, device)
        pos_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        plens_t = _to_device(torch.tensor(plens), device)
        if forced_tokens is not None:
            forced_tokens = _to_device(torch.as_tensor(forced_tokens), device)  # once, not per step
        gen = torch.Generator(device=device).manual_seed(seed)

        path = self.decode_path(device)  # raises before anything is begun or changed
        rec = self.recorder
        prev_mode = rt.mode
        prev_attn = model.config._attn_implementation
        if self.attn_implementation is not None:
            model.config._attn_implementation = self.attn_implementation
        rt.set_mode(mode)
        collect = rec is not None or self.keep_codes or self.collect_routes
        rt.capture = self._on_capture if (rec is not None or self.keep_codes) else None
        rt.on_route = self._on_route if collect else None
        self._codes, self._experts = {}, {}
        prompt_pos = np.concatenate([np.arange(n) for n in plens])  # the prompt rows' (request, position)
        prompt_rids = [r for r, n in zip(rids, plens) for _ in range(n)]
        n_fed = max_new_tokens if self.feed_last else max(max_new_tokens - 1, 0)  # decode steps fed
        if rec is not None:
            for r in rids:
                rec.begin(r, policy_version)
            rec.record_tokens(
                prompt_rids,
                prompt_pos,
                torch.cat([torch.as_tensor(list(p), dtype=torch.long) for p in prompts]),
                torch.full((len(prompt_pos),), float("nan")),
            )
        try:
            from transformers import DynamicCache

            cache = fp4_kv_cache(model, rt) or DynamicCache(config=model.config)
            # Prefill: valid rows of the flattened [B, Pmax] batch (left-padded), from the host lengths
            # (``mask.nonzero()`` would read the device mask: a host sync).
            pmax = max(plens)
            valid = _to_device(
                torch.as_tensor(np.concatenate([b * pmax + np.arange(pmax - n, pmax) for b, n in enumerate(plens)])),
                device,
            )
            self._rows = (prompt_rids, prompt_pos, valid)
            dec = None
            prepare_s = 0.0  # tracing / capturing the decode step (not part of decode_s)
            if path != "hf" and n_fed > 0:
                tp = time.perf_counter()
                dec = StaticDecoder(model, rt, batch=bsz, max_len=pmax + n_fed, ring=self.ring,
                                    capture=rt.capture is not None, keep_codes=self.keep_codes,
                                    routes=rt.on_route is not None, use_graph=path == "graph")
                dec.prepare()
                prepare_s = time.perf_counter() - tp
            t0 = time.perf_counter()
            out = model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=pos_ids,
                use_cache=True,
                logits_to_keep=1,
                **{self._cache_kw: cache},
            )
            if rec is not None:
                rec.step()
            logits = out.logits[:, -1, :]  # (B, V)
            if dec is not None:
                dec.load_prefill(cache, mask, plens_t)
                del out, cache  # the static cache holds the prompt now
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t1 = time.perf_counter()
            toks, lps = [], []
            window: list[np.ndarray] = []  # positions of the steps in the decoder's ring
            for step in range(max_new_tokens):
                logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # (B, V)
                if forced_tokens is not None:
                    tok = forced_tokens[:, step]
                else:
                    tok = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(-1)
                lp = logp.gather(-1, tok[:, None]).squeeze(-1)
                toks.append(tok)
                lps.append(lp)
                positions = np.asarray(plens) + step
                if rec is not None:
                    rec.record_tokens(rids, positions, tok, lp)
                if step == max_new_tokens - 1 and not self.feed_last:
                    break
                if dec is not None:
                    logits = dec.step(tok)
                    window.append(positions)
                    if len(window) == dec.ring:
                        self._take_ring(dec, window, rids)
                        window = []
                else:
                    mask = torch.cat([mask, torch.ones(bsz, 1, dtype=mask.dtype, device=device)], dim=-1)
                    self._rows = (rids, positions, None)  # decode: every batch row is a request's token
                    out = model(
                        input_ids=tok[:, None],
                        attention_mask=mask,
                        position_ids=(plens_t + step)[:, None],
                        use_cache=True,
                        **{self._cache_kw: cache},
                    )
                    logits = out.logits[:, -1, :]
                if rec is not None:
                    rec.step()
            if window:
                self._take_ring(dec, window, rids)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t2 = time.perf_counter()
            if rec is not None:
                for r in rids:
                    rec.end(r)
        finally:
            rt.capture = rt.on_route = None
            rt.set_mode(prev_mode)
            model.config._attn_implementation = prev_attn
            self._rows = None
        # Everything the result holds comes to the host in one transfer per device (per-part copies were a
        # host sync per MoE layer per forward: the whole cost of capture in the sync check).
        expert_parts = list(self._experts.items())
        code_parts = list(self._codes.items())
        dev = [torch.stack(toks, dim=1) if toks else torch.zeros(bsz, 0, dtype=torch.long),
               torch.stack(lps, dim=1) if lps else torch.zeros(bsz, 0)]
        for _, parts in expert_parts + code_parts:
            dev.extend(val for _, _, val in parts)
        host = iter(_to_host(dev))
        gen_toks, gen_lps = next(host), next(host)  # (B, G) each
        experts = {la: self._assemble([(r, p, next(host)) for r, p, _ in parts], rids, plens, n_fed)
                   for la, parts in expert_parts}
        codes = {s: self._assemble([(r, p, next(host)) for r, p, _ in parts], rids, plens, n_fed)
                 for s, parts in code_parts}
        seqs = [np.concatenate([np.asarray(p, dtype=np.int64), gen_toks[b]]) for b, p in enumerate(prompts)]
        return RolloutResult(
            request_ids=rids,
            prompt_lens=plens,
            sequences=seqs,
            logprobs=[gen_lps[b].astype(np.float32) for b in range(bsz)],
            experts=experts,
            codes=codes,
            prefill_s=t1 - t0,
            decode_s=t2 - t1,
            decode_steps=n_fed,
            decode_path=path,
            prepare_s=prepare_s,
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
