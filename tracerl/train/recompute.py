"""Hint-guided QAT recompute for Hugging Face MoE models (the trainer's side of TRACE).

The trainer recomputes a packed micro-batch (`tracerl.train.packing.PackedHints`) in one full-sequence forward,
with no KV cache: a different numerical path from the rollout's token-by-token decode. The model carries an
`FP4Runtime` with the rollout's site plan and global scales; the mode picks what the FP4 sites do
(`tracerl.policy.runtime.MODES`). In ``fp4_rne_rollout_scales`` and ``fp4_hints`` the hinted sites take the rollout's
block scales (and hint bits) from the packed batch, row for row.

Compute layout: the THD batch is the data layout; how the model runs it is ``layout``:

- ``"padded"`` (default): the segments right-padded as [S, L_max]; hints are scattered to the padded rows
  and pad rows get scale 0. Attention costs S * L_max^2, and it is the only layout for models with
  linear-attention layers (Qwen3.5-MoE's Gated DeltaNet has no varlen path in torch).
- ``"packed"``: one row [1, T] with per-segment positions (Hugging Face's packed-sequence detection turns the
  position resets into a block-diagonal causal mask). Without a varlen attention kernel (flash-attention)
  that mask costs T^2, so it only pays with one.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Collection

import numpy as np
import torch

from tracerl.errors import ConfigError
from tracerl.hints import PackedHints
from tracerl.policy import FP4Runtime, cache_kwarg, check_mode, fp4_kv_cache, has_linear_attention, moe_blocks
from tracerl.train.attention import own_sdpa_mask, sdpa_hook_available, sdpa_padding_mask
from tracerl.util import sync, to_device, to_host


@dataclasses.dataclass
class RecomputeResult:
    mode: str
    logprobs: np.ndarray  # float32 [T]: log p(token t | tokens < t of its segment); NaN at segment starts
    routes: dict[int, np.ndarray]  # layer -> uint8 [T, top_k], ascending expert ids per token
    codes: dict[str, np.ndarray]  # hinted site -> uint8 [T, W] effective E2M1 codes (FP4 modes)
    scales: dict[str, np.ndarray]  # hinted site -> uint8 [T, W/16] block scales used
    loss: float | None
    grad_norm: float | None
    seconds: float


@dataclasses.dataclass
class TokenLogprobs:
    """What `QATTrainer.token_logprobs` returns: device tensors of one forward."""

    logprobs: torch.Tensor | None  # float32 [S] (S scored tokens), with gradient when grad was enabled
    scored: np.ndarray  # int64 [S]: THD row of each scored token (every token but each segment's first)
    routes: dict[int, torch.Tensor]  # layer -> uint8 [T, top_k]
    codes: dict[str, torch.Tensor]  # hinted site -> uint8 [T, W] effective codes (with observe)
    scales: dict[str, torch.Tensor]  # hinted site -> uint8 [T, W/16] (with observe)


class QATTrainer:
    """Forward (+ backward) of packed micro-batches in one of `tracerl.policy.runtime.MODES`."""

    def __init__(self, model: torch.nn.Module, runtime: FP4Runtime, *, layout: str = "padded"):
        if layout not in ("padded", "packed"):
            raise ConfigError(f"layout {layout!r}; supported: padded, packed")
        if layout == "packed" and has_linear_attention(model):
            raise ConfigError("layout='packed' needs a model without linear-attention layers; use 'padded'")
        self.model = model
        self.runtime = runtime
        self.padded = layout == "padded"

    def _layout(self, packed: PackedHints, device) -> tuple[dict, torch.Tensor]:
        """Model inputs and the flat forward row of each THD token (long [T])."""
        cu = packed.cu_seqlens
        starts = packed.positions[cu[:-1]] if len(cu) > 1 else np.zeros(0)
        if (starts != 0).any():
            raise ConfigError(
                "the single-process recompute needs whole sequences (each segment starting at position 0); "
                f"got segment starts at positions {starts[starts != 0][:4].tolist()} (context-parallel chunks "
                "need ring attention across ranks)"
            )
        tok = torch.as_tensor(packed.token_ids, dtype=torch.long)
        pos = torch.as_tensor(packed.positions, dtype=torch.long)
        # host -> device through pinned memory without a host sync (a pageable .to(cuda) waits for the queue)
        if not self.padded:
            inputs = {"input_ids": to_device(tok[None], device), "position_ids": to_device(pos[None], device)}
            return inputs, torch.arange(len(tok), device=device)
        lens = np.diff(cu)
        nseg, lmax = len(lens), int(lens.max())
        ids = torch.zeros(nseg, lmax, dtype=torch.long)
        mask = torch.zeros(nseg, lmax, dtype=torch.long)
        rows = np.concatenate([b * lmax + np.arange(n) for b, n in enumerate(lens)])
        ids.view(-1)[torch.as_tensor(rows)] = tok
        mask.view(-1)[torch.as_tensor(rows)] = 1
        inputs = {
            "input_ids": to_device(ids, device),
            "attention_mask": to_device(mask, device),
            "position_ids": to_device((mask.cumsum(-1) - 1).clamp(min=0), device),
        }
        return inputs, to_device(torch.as_tensor(rows), device)

    def _own_sdpa_mask(self) -> bool:
        """Whether the padded layout gives SDPA its mask itself (`own_sdpa_mask`): with SDPA attention, no FP4 KV
        cache, no linear-attention layers (they read the 2D padding mask) and no sliding window (its mask
        differs). Hugging Face makes the same mask from the 2D one, but first asks the device whether there is any
        padding (one host sync per forward, which drains the queue); the host knows that already."""
        cfg = getattr(self.model, "config", None)
        return (getattr(cfg, "_attn_implementation", None) == "sdpa" and getattr(cfg, "sliding_window", None) is None
                and not self.runtime.plan.has_kv and not has_linear_attention(self.model) and sdpa_hook_available())

    def recompute(
        self, packed: PackedHints, mode: str, *, backward: bool = False, observe: bool = True,
        replay_routes: bool = False,
    ) -> RecomputeResult:
        """Forward (and with ``backward`` the straight-through backward of a mean-NLL loss) of ``packed`` in
        ``mode``; with ``replay_routes`` every MoE layer uses the rollout's routed experts from
        ``packed.experts`` (routing replay), weighted by the trainer router's own probabilities.

        Raises `ConfigError` for an unknown mode, missing hinted sites (rollout-scale modes) or missing routes
        (``replay_routes``), and `HintMismatchError` for hints/scales/routes of the wrong shape."""
        device = next(self.model.parameters()).device
        t0 = time.perf_counter()
        with torch.set_grad_enabled(backward):
            fwd = self.token_logprobs(packed, mode, observe=observe, replay_routes=replay_routes)
            lp, scored = fwd.logprobs, fwd.scored
            loss, grad_norm = self._backward(lp, packed, scored) if backward else (None, None)
        sync(device)
        secs = time.perf_counter() - t0
        # Everything comes to the host in one transfer (a .cpu() per layer and site was one blocking copy each).
        routes, codes, scales = fwd.routes, fwd.codes, fwd.scales
        host = iter(to_host([lp.detach().float(), *routes.values(), *codes.values(), *scales.values()]))
        out = np.full(len(packed.token_ids), np.nan, dtype=np.float32)
        out[scored] = next(host)
        return RecomputeResult(
            mode=mode,
            logprobs=out,
            routes={k: next(host) for k in routes},
            codes={k: next(host) for k in codes},
            scales={k: next(host) for k in scales},
            loss=loss,
            grad_norm=grad_norm,
            seconds=secs,
        )

    def token_logprobs(
        self, packed: PackedHints, mode: str, *, observe: bool = False, replay_routes: bool = False,
        temperature: float = 1.0, routes: bool = True, substituted: Collection[str] = (),
    ) -> TokenLogprobs:
        """One forward of ``packed`` in ``mode``: the log-probs of its scored tokens (with gradient when grad is
        enabled), and what the forward saw on the device (routes; with ``observe`` the hinted sites' codes and
        scales), for the caller to turn into a loss. ``temperature`` divides the logits first (as the rollout's
        sampler did). ``substituted``: hinted sites the runtime's ``substitute`` quantizes (margin sites,
        `tracerl.hints.MarginSites`): ``packed`` needs no scales or hints for them and none go to the device.
        Raises what `recompute` raises."""
        check_mode(mode)
        device = next(self.model.parameters()).device
        inputs, rows = self._layout(packed, device)
        nrows = int(inputs["input_ids"].numel())
        provided = self._provided(packed, mode, rows, nrows, device, skip=substituted)
        forced = self._forced_routes(packed, rows, nrows, device) if replay_routes else {}
        out = TokenLogprobs(None, np.zeros(0, dtype=np.int64), {}, {}, {})

        def on_observe(site, c, s):
            out.codes[site] = c.index_select(0, rows)
            out.scales[site] = s.index_select(0, rows)

        def on_route(layer, idx):
            out.routes[layer] = idx.index_select(0, rows).to(torch.uint8)

        with self.runtime.using(mode=mode, provided=provided, forced_routes=forced,
                                on_route=on_route if routes else None, observe=on_observe if observe else None):
            lens = np.diff(packed.cu_seqlens)
            logits = self._forward(inputs, rows, padded=lens.size > 0 and bool((lens != lens.max()).any()))  # (T, V)
            # Token t is scored by the logits at t-1 of the same segment. Which tokens (and which of them are
            # response tokens) is known on the host: computed there and sent once, so nothing between the forward
            # and the backward waits for the device.
            scored = np.setdiff1d(np.arange(len(packed.token_ids)), packed.cu_seqlens[:-1])
            idx, tok = (to_device(torch.as_tensor(a), device)
                        for a in (scored, np.asarray(packed.token_ids, dtype=np.int64)[scored]))
            logits = logits.index_select(0, idx - 1).float()
            if temperature != 1.0:
                logits = logits / temperature
            out.logprobs = torch.log_softmax(logits, dim=-1).gather(-1, tok[:, None])[:, 0]
        out.scored = scored
        return out

    def _provided(self, packed: PackedHints, mode: str, rows, nrows: int, device,
                  skip: Collection[str] = ()) -> dict:
        """The rollout's scales (and, in ``fp4_hints``, hints) of every hinted site but ``skip`` in forward rows;
        empty in the modes that use their own scales."""
        if mode not in ("fp4_rne_rollout_scales", "fp4_hints"):
            return {}
        sites = [s for s in self.runtime.plan.hinted if s not in skip]
        for site in sites:
            if site not in packed.scales:
                raise ConfigError(f"mode {mode} needs site {site} in the packed batch; it has "
                                  f"{sorted(packed.scales)[:4]}")
        hints = mode == "fp4_hints"
        arrays = [packed.scales[s] for s in sites] + ([packed.hints[s] for s in sites] if hints else [])
        # On a GPU the sites' rows go over stacked (one host buffer, copy and scatter per row width, not per site
        # and array: 40 of each per forward on the H200 model); on the CPU each array is used where it lies.
        out = (self._scatter_stacked(arrays, rows, nrows, device) if torch.device(device).type == "cuda"
               else [self._scatter(a, rows, nrows, device) for a in arrays])
        n = len(sites)
        return {site: (out[i], out[n + i] if hints else None) for i, site in enumerate(sites)}

    def _forced_routes(self, packed: PackedHints, rows, nrows: int, device) -> dict[int, torch.Tensor]:
        """Routing replay: every MoE layer's recorded expert ids (int64 [nrows, top_k]) in forward rows."""
        forced = {}
        for layer, name, _ in moe_blocks(self.model):
            ids = packed.experts.get(name) if packed.experts else None
            if ids is None:
                raise ConfigError(f"replay_routes needs the routed experts of {name} in the packed batch; it has "
                                  f"{sorted(packed.experts or {})[:4]}")
            forced[layer] = self._scatter(ids, rows, nrows, device).long()
        return forced

    def _forward(self, inputs: dict, rows: torch.Tensor, padded: bool = True) -> torch.Tensor:
        """Logits (T, V) of the THD tokens from one full-sequence forward (no KV cache unless the KV cache is
        FP4: then K/V are quantized as the rollout's cache stored them). ``padded``: whether the padded layout's
        rows have any padding (known on the host)."""
        model = self.model
        kv = fp4_kv_cache(model, self.runtime)
        if kv is None and self.padded and self._own_sdpa_mask():
            mask = sdpa_padding_mask(inputs["attention_mask"]) if padded else None
            with own_sdpa_mask(model, mask):
                logits = model(**inputs, use_cache=False).logits  # (B, L, V)
        elif kv is None:
            logits = model(**inputs, use_cache=False).logits  # (B, L, V)
        else:
            if not self.padded:
                raise ConfigError("FP4 KV-cache sites need layout='padded' (a cache disables packing)")
            logits = model(**inputs, use_cache=True, **{cache_kwarg(model): kv}).logits
        return logits.reshape(-1, logits.shape[-1]).index_select(0, rows)

    def _backward(self, lp: torch.Tensor, packed: PackedHints, scored: np.ndarray) -> tuple[float, float]:
        """Backward of a stand-in for the policy-gradient loss, the mean NLL of the response tokens (all scored
        tokens when there is none); returns the loss and the global gradient norm."""
        model = self.model
        resp = np.flatnonzero(~np.isnan(np.asarray(packed.logprobs)[scored]))
        loss = -(lp.index_select(0, to_device(torch.as_tensor(resp), lp.device)).mean() if resp.size else lp.mean())
        model.zero_grad(set_to_none=True)
        loss.backward()
        norms = [p.grad.float().norm() for p in model.parameters() if p.grad is not None]
        grad_norm = float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0
        return float(loss.detach()), grad_norm

    @staticmethod
    def _scatter_stacked(arrays, rows: torch.Tensor, nrows: int, device) -> list[torch.Tensor]:
        """`_scatter` of several THD arrays [T, C_i] at once: numpy arrays of one dtype and width are copied into
        one host buffer [S, T, C] (pinned on CUDA), sent in one copy and scattered to forward rows in one index
        put; each result is a contiguous [nrows, C] slice of it, equal to `_scatter`'s. Torch tensors and arrays
        of other shapes take `_scatter`."""
        device = torch.device(device)
        out: list[torch.Tensor | None] = [None] * len(arrays)
        groups: dict[tuple, list[int]] = {}
        for i, a in enumerate(arrays):
            if isinstance(a, np.ndarray) and a.ndim == 2:
                groups.setdefault((a.dtype.str, a.shape), []).append(i)
            else:
                out[i] = QATTrainer._scatter(a, rows, nrows, device)
        for (_, (t, c)), idx in groups.items():
            if len(idx) == 1:
                out[idx[0]] = QATTrainer._scatter(arrays[idx[0]], rows, nrows, device)
                continue
            dtype = torch.from_numpy(arrays[idx[0]][:0]).dtype
            host = torch.empty((len(idx), t, c), dtype=dtype, pin_memory=device.type == "cuda")
            view = host.numpy()
            for j, i in enumerate(idx):
                view[j] = arrays[i]
            src = host.to(device, non_blocking=True)
            if nrows != t:
                full = torch.zeros((len(idx), nrows, c), dtype=dtype, device=device)
                full[:, rows] = src  # an index put, as `_scatter`'s (deterministic under deterministic algorithms)
                src = full
            for j, i in enumerate(idx):
                out[i] = src[j]
        return out

    @staticmethod
    def _scatter(arr, rows: torch.Tensor, nrows: int, device) -> torch.Tensor:
        """THD rows [T, C] (numpy, or torch on any device) -> forward rows [nrows, C]; rows the batch does not
        cover stay 0 (scale 0 -> 0)."""
        if isinstance(arr, torch.Tensor):
            src = arr.to(device, non_blocking=True)
        else:
            src = to_device(torch.as_tensor(np.ascontiguousarray(arr)), device)  # no host sync per site
        if nrows == src.shape[0]:
            return src
        out = torch.zeros(nrows, src.shape[1], dtype=src.dtype, device=device)
        out[rows] = src
        return out
