"""Reference FP4 rollout engine: batched prefill + token-by-token decode with a KV cache, seeded sampling.

The model carries an `FP4Runtime` (`tracerl.qat.install_fp4`); the engine runs it in ``fp4_rne_own_scales``
(the FP4 rollout) or ``bf16`` (the floor run) and, at hinted sites, receives each `kernels.quantize` result
through the runtime's capture callback and hands hint bits and block scales to a `RolloutRecorder` along with
the routed expert ids, the sampled tokens and their log-probs. Nothing here synchronizes with the device per
step except what the model's own expert dispatch does; captured payloads stay on the device until the
recorder drains them. By default the last sampled token is fed through one more forward (``feed_last``) so
that every recorded token has its hints, scales and routed experts; its logits are discarded.

The decode path is the engine's own: by default it runs attention through PyTorch's SDPA kernels while the
trainer recompute uses eager attention, as a serving engine's paged decode kernels differ from a trainer's
varlen attention; ``attn_implementation=None`` keeps whatever the model is configured with.

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

from tracerl.qat import FP4Runtime, fp4_kv_cache
from tracerl.recorder import RolloutRecorder


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


def _cache_kwarg(model: torch.nn.Module) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class RolloutEngine:
    """Generates batches with ``model`` (an HF MoE causal LM with an installed `FP4Runtime`)."""

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
    ):
        self.model = model
        self.runtime = runtime
        self.recorder = recorder
        self.record_experts = record_experts
        self.keep_codes = keep_codes
        self.feed_last = feed_last
        self.attn_implementation = attn_implementation
        self.collect_routes = collect_routes
        self._cache_kw = _cache_kwarg(model)
        self._rows: tuple[list[str], np.ndarray, torch.Tensor] | None = None
        self._codes: dict[str, list] = {}
        self._experts: dict[int, list] = {}

    # Callbacks from the runtime: rows of the current forward -> (request ids, positions).
    def _on_capture(self, site: str, q) -> None:
        rids, pos, rows = self._rows
        hints = q.hints if rows is None else q.hints.index_select(0, rows)
        scales = q.scales if rows is None else q.scales.index_select(0, rows)
        if self.recorder is not None:
            self.recorder.record_sites(rids, pos, site, hints, scales)
        if self.keep_codes:
            self._codes.setdefault(site, []).append((rids, pos, q.codes if rows is None else q.codes.index_select(0, rows)))

    def _on_route(self, layer: int, idx: torch.Tensor) -> None:
        rids, pos, rows = self._rows
        ids = (idx if rows is None else idx.index_select(0, rows)).to(torch.uint8)
        name = f"model.layers.{layer}.mlp"
        if self.recorder is not None and self.record_experts and name in self.recorder.moe_layers:
            self.recorder.record_experts(rids, pos, name, ids)
        self._experts.setdefault(layer, []).append((rids, pos, ids))

    def _left_pad(self, prompts, device):
        plens = [len(p) for p in prompts]
        pmax = max(plens)
        ids = torch.zeros(len(prompts), pmax, dtype=torch.long)
        mask = torch.zeros(len(prompts), pmax, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, pmax - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
            mask[b, pmax - len(p) :] = 1
        return plens, ids.to(device), mask.to(device)

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
        plens_t = torch.tensor(plens, device=device)
        gen = torch.Generator(device=device).manual_seed(seed)

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
        if rec is not None:
            for r in rids:
                rec.begin(r, policy_version)
            prompt_pos = np.concatenate([np.arange(n) for n in plens])
            prompt_rids = [r for r, n in zip(rids, plens) for _ in range(n)]
            rec.record_tokens(
                prompt_rids,
                prompt_pos,
                torch.cat([torch.as_tensor(list(p), dtype=torch.long) for p in prompts]),
                torch.full((len(prompt_pos),), float("nan")),
            )
        try:
            from transformers import DynamicCache

            cache = fp4_kv_cache(model, rt) or DynamicCache(config=model.config)
            # Prefill: valid rows of the flattened [B, Pmax] batch.
            valid = mask.reshape(-1).nonzero().squeeze(-1)
            self._rows = (
                [r for r, n in zip(rids, plens) for _ in range(n)],
                np.concatenate([np.arange(n) for n in plens]),
                valid,
            )
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
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t1 = time.perf_counter()
            logits = out.logits[:, -1, :]  # (B, V)
            toks, lps = [], []
            for step in range(max_new_tokens):
                logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # (B, V)
                if forced_tokens is not None:
                    tok = forced_tokens[:, step].to(device)
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
        fed = max_new_tokens if self.feed_last else max_new_tokens - 1
        gen_toks = torch.stack(toks, dim=1).cpu().numpy()  # (B, G)
        gen_lps = torch.stack(lps, dim=1).cpu().numpy()
        seqs = [np.concatenate([np.asarray(p, dtype=np.int64), gen_toks[b]]) for b, p in enumerate(prompts)]
        return RolloutResult(
            request_ids=rids,
            prompt_lens=plens,
            sequences=seqs,
            logprobs=[gen_lps[b].astype(np.float32) for b in range(bsz)],
            experts={la: self._assemble(parts, rids, plens, fed) for la, parts in self._experts.items()},
            codes={s: self._assemble(parts, rids, plens, fed) for s, parts in self._codes.items()},
            prefill_s=t1 - t0,
            decode_s=t2 - t1,
            decode_steps=max_new_tokens if self.feed_last else max(max_new_tokens - 1, 0),
        )

    @staticmethod
    def _assemble(parts, rids, plens, gen) -> list[np.ndarray]:
        """Per-step captures -> per request arrays over the fed positions [0, P_b + fed)."""
        index = {r: i for i, r in enumerate(rids)}
        width = tuple(parts[0][2].shape[1:])
        dense = np.zeros((len(rids), max(plens) + gen, *width), dtype=np.uint8)
        for prid, ppos, val in parts:
            b = np.fromiter((index[r] for r in prid), dtype=np.int64, count=len(prid))
            dense[b, np.asarray(ppos)] = val.cpu().numpy()
        return [dense[i, : plens[i] + gen] for i in range(len(rids))]
