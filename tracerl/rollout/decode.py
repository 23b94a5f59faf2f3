"""Static-shape decode for the reference rollout engine, replayable as one CUDA graph per step.

Serving engines (SGLang, vLLM) decode under CUDA graphs: one step of the whole model is captured once and
replayed, so the host launches one graph instead of thousands of kernels. A hint recorder that works inside a
serving engine therefore has to work inside a graph: no host sync, no host-side bookkeeping per kernel, and no
tensor that the next replay overwrites before it is copied out. `StaticDecoder` is the reference engine's
version of that decode path:

- a preallocated KV cache per layer (``[B, kv_heads, max_len, head_dim]``) written in place at a device-side
  column counter, and a ``valid [B, max_len]`` mask (left padding and not-yet-written columns are invalid);
- attention over the whole buffer with SDPA and the mask, the query heads grouped per KV head (GQA without
  copying K/V);
- the step's own state (input token, per-row position, column, ring slot) as device tensors advanced in place
  at the end of the step, so a replay needs no host input but the sampled token;
- captures (hint bits, block scales, codes at hinted sites; routed expert ids per MoE layer) staged in one
  device buffer per step (the fused quantize kernel writes a hinted site's hint bits and scales, and its margin
  marks, straight into it; the router's sort writes its expert ids into it; codes take one copy each) and put into
  a ring of ``ring`` steps by one copy per step, at the ring slot; the engine hands the filled ring to the
  recorder every ``ring`` steps (one clone per field), where the recorder's asynchronous drains take over.

The same code runs eagerly (``use_graph=False``: CPU, or to compare against the graph) and captured.
Supported: the ``qwen3-moe`` family (full attention in every layer). Models with linear attention keep the
Hugging Face decode path (`RolloutEngine` picks it).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

import tracefp4
from tracerl.errors import ConfigError
from tracerl.policy import FP4Runtime, has_linear_attention

log = logging.getLogger(__name__)

RingKey = tuple[str, str]  # ("site", site name) or ("route", layer index as str)

# One graph capture at a time in this process. Captures are thread-local (``capture_error_mode``), so another
# thread may run kernels (or replay its own graph) meanwhile, as the audit's side-by-side decodes do.
_CAPTURE_LOCK = threading.Lock()


def supports_static_decode(model: nn.Module) -> bool:
    """True when `StaticDecoder` can run ``model`` (decoder layers with full softmax attention only)."""
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or has_linear_attention(model):
        return False
    need = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
    return all(all(hasattr(getattr(la, "self_attn", None), n) for n in need) for la in inner.layers) and not getattr(
        model.config, "use_sliding_window", False
    )


def _rope_fn() -> Callable:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import apply_rotary_pos_emb

    return apply_rotary_pos_emb


def _cache_layer(cache, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values) [B, kv_heads, T, D] of layer ``i`` of a transformers `DynamicCache` (4.x or 5.x layout)."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return layers[i].keys, layers[i].values
    return cache.key_cache[i], cache.value_cache[i]


def margin_marks_at(runtime: FP4Runtime, site: str, x: torch.Tensor, scales: torch.Tensor, hints: torch.Tensor,
                    points: Sequence[tuple[float, float]],
                    outs: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None
                    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``tracefp4.margin_marks`` of ``site``'s activation x [N, W] with the scales uint8 [N, W/16] and hints uint8
    [N, W/8] it was quantized to, at each (value margin, scale margin) of ``points``, on x's device with the
    runtime's global scale and backend (no host sync): [(value marks uint8 [N, W/8], block marks uint8
    [N, ceil(W/128)])], written into ``outs`` (one pair per point) when given."""
    g = runtime.global_scale_on(site, x.device)
    outs = outs or [None] * len(points)
    return [tracefp4.margin_marks(x, g, scales, hints, m, ms, backend=runtime.backend, out=o)
            for (m, ms), o in zip(points, outs)]


class StaticDecoder:
    """One decode step of ``model`` over a preallocated KV cache; optionally captured as a CUDA graph.

    Parameters
    ----------
    model: a Hugging Face causal LM accepted by `supports_static_decode`, with an installed `FP4Runtime`.
    runtime: that runtime. Its mode and its ``capture`` / ``on_route`` callbacks are read when the step is
        traced (`prepare`): a graph replays what was traced, so the engine builds one decoder per configuration.
    batch: rows B. max_len: KV columns (prompt columns + decode steps).
    ring: steps per capture ring (the engine hands rings to the recorder when full).
    capture: record hinted sites (hint bits and scales, plus codes when ``keep_codes``).
    routes: record routed expert ids of every MoE layer (uint8 [B, top_k] per step).
    use_graph: capture the step as a CUDA graph (CUDA only).
    marks: site -> its (value margin, scale margin) points (a callable; empty: none): with ``capture``, also
        each captured site's ``tracefp4.margin_marks`` at its points (value marks uint8 [B, W/8], block marks
        uint8 [B, ceil(W/128)], after the codes in the site's ring parts), computed in the step from its
        activation (no host sync).
    marks_stream: on CUDA, run the marks kernels on a side stream forked from the step's stream at each site and
        joined before the step's ring write (a branch of the graph beside the step's next kernels); the site's
        activation, scales and hints are held until the join. Off by default: on an H100 (20 sites, graph decode)
        it made the step slower, not faster (margin capture +2.09% vs +1.52% at batch 4, +2.00% vs +1.44% at 16:
        the fork and join per site cost more than the marks kernels; `capture-margin-side-stream-h100.json`). The
        same bits either way.
    fuse_marks: a site with one margin point gets its marks from the capture kernel itself, in the pass that
        quantizes it (`tracefp4.quantize_fake` ``marks``, into the stage's views: no launch of its own) once the
        stage exists; False: a `margin_marks` launch per site (as sites with several points always do). The same
        bits either way.

    Raises `ConfigError` for an unsupported model or ``use_graph`` off CUDA.
    """

    def __init__(
        self,
        model: nn.Module,
        runtime: FP4Runtime,
        *,
        batch: int,
        max_len: int,
        ring: int = 32,
        capture: bool = False,
        keep_codes: bool = False,
        routes: bool = False,
        use_graph: bool = False,
        marks: Callable[[str], Sequence[tuple[float, float]]] | None = None,
        marks_stream: bool = False,
        fuse_marks: bool = True,
    ):
        if not supports_static_decode(model):
            raise ConfigError("static decode supports full-attention decoder models (qwen3-moe); "
                              f"got {type(model).__name__}")
        device = next(model.parameters()).device
        if use_graph and device.type != "cuda":
            raise ConfigError(f"CUDA-graph decode needs a CUDA model, got device {device}")
        if ring < 1 or batch < 1 or max_len < 1:
            raise ConfigError(f"batch={batch}, max_len={max_len}, ring={ring} must be >= 1")
        cfg = model.config
        self.model, self.runtime, self.device = model, runtime, device
        self.batch, self.max_len, self.ring = batch, max_len, ring
        self.capture, self.keep_codes, self.routes, self.use_graph = capture, keep_codes, routes, use_graph
        self.marks = marks or (lambda site: ())
        self._x: dict[str, torch.Tensor] = {}  # site -> this step's activation (with marks)
        self._fuse_marks = fuse_marks
        self._served_marks: str | None = None  # the site whose marks the capture kernel just wrote
        # the marks' side stream (CUDA) and what its kernels read, held until the step joins it
        self._marks_stream = torch.cuda.Stream(device) if marks_stream and device.type == "cuda" else None
        self._held: list[torch.Tensor] = []
        self.num_layers = cfg.num_hidden_layers
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.groups = cfg.num_attention_heads // self.kv_heads
        self.top_k = cfg.num_experts_per_tok
        dtype = next(model.parameters()).dtype
        shape = (batch, self.kv_heads, max_len, self.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(self.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(self.num_layers)]
        self.valid = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        self.tok = torch.zeros(batch, dtype=torch.long, device=device)  # input token of the next step
        self.pos = torch.zeros(batch, dtype=torch.long, device=device)  # its position per row
        self.col = torch.zeros(1, dtype=torch.long, device=device)  # its KV column (same for every row)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)  # ring slot this step writes
        self.logits: torch.Tensor | None = None  # [B, V] of the last step (overwritten by the next one)
        # Captures of one step, packed: ``_stage`` uint8 [S] holds every capture part (hint bits, scales, codes,
        # routes) at a 16-byte aligned offset; ``_ring`` uint8 [ring, S] keeps ``ring`` steps of it, written by
        # one copy per step. Hinted sites' hints and scales are written into their stage views by the fused
        # quantize kernel itself (`FP4Runtime` ``capture_into``), so a site costs no copy of its own.
        # part -> (byte offset, shape, dtype): uint8 parts, and the routes as the router's int64 ids (sorted into
        # their stage view: `FP4Runtime` ``route_into``)
        self._layout: dict[RingKey, list[tuple[int, tuple[int, ...], torch.dtype]]] = {}
        self._views: dict[RingKey, list[torch.Tensor]] = {}  # stage views per part
        self._pending: dict[RingKey, list[torch.Tensor]] = {}  # parts seen before the stage exists (first step)
        self._stage: torch.Tensor | None = None
        self._ring: torch.Tensor | None = None
        self._served: str | None = None  # the site whose capture `_stage_for` just handed out
        self._served_route: int | None = None  # the layer whose routes `_route_for` just handed out
        self._kv_sites = runtime.plan.has_kv
        self._rope = _rope_fn()
        self._graph: torch.cuda.CUDAGraph | None = None
        self._ready = False

    # ---- callbacks (called while the step is traced or run eagerly) --------------------------------------
    def _ring_write(self, key: RingKey, parts: tuple[torch.Tensor | None, ...]) -> None:
        """This step's capture ``parts`` (uint8, or int ids that fit a byte) into their stage views; None: the part
        is already there (written by the quantize kernel)."""
        views = self._views.get(key)
        if views is None:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise ConfigError(f"capture {key} first seen while a graph was being captured (no warm-up?)")
            # the stage is built after the step
            self._pending[key] = [p.clone() if p.dtype == torch.int64 else p.to(torch.uint8, copy=True)
                                  for p in parts]
            return
        for v, p in zip(views, parts):
            if p is not None:
                v.copy_(p)

    def _stage_for(self, site: str, x: torch.Tensor) -> tuple | None:
        """`FP4Runtime` ``capture_into``: the stage views (scales [B, W/16], hints [B, W/8]) that the fused kernel
        writes ``site``'s capture into, and with one margin point at the site its marks' views and that point (the
        kernel computes the marks in the same pass: `tracefp4.quantize_fake` ``marks``); None before the stage
        exists or for a shape it was not built for."""
        points = self.marks(site)
        views = self._views.get(("site", site))
        if views is None or views[0].shape[0] != x.shape[0]:
            if points:
                self._x[site] = x
            return None
        self._served = site  # the next `_on_capture` of this site finds its hints and scales in place
        if len(points) == 1 and self._fuse_marks and len(views) == 2 + self.keep_codes + 2:
            vm, bm = views[-2:]
            n, w = x.shape
            if (tuple(vm.shape), tuple(bm.shape)) == ((n, w // 8), (n, -(-w // 128))):
                self._served_marks = site
                return views[1], views[0], (vm, bm), tuple(points[0])
        if points:
            self._x[site] = x
        return views[1], views[0]

    def _on_capture(self, site: str, q) -> None:
        direct, self._served = self._served == site, None
        parts = ((None, None) if direct else (q.hints, q.scales)) + ((q.codes,) if self.keep_codes else ())
        if self._served_marks == site:  # the capture kernel wrote the marks into their views too
            self._served_marks = None
            self._ring_write(("site", site), parts + (None, None))
            return
        x = self._x.pop(site, None)
        if x is not None:
            points = self.marks(site)
            views = self._views.get(("site", site))
            outs = None  # once the stage exists, the marks kernel writes into its views: no copy per site
            if views is not None and len(views) == len(parts) + 2 * len(points):
                outs = [tuple(views[len(parts) + 2 * j: len(parts) + 2 * j + 2]) for j in range(len(points))]
                n, w = x.shape
                if any((tuple(v.shape), tuple(b.shape)) != ((n, w // 8), (n, -(-w // 128))) for v, b in outs):
                    outs = None
            marks = self._marks(site, x, q.scales, q.hints, points, outs)
            for pair in marks:
                parts += (None, None) if outs is not None else pair
        self._ring_write(("site", site), parts)

    def _marks(self, site: str, x: torch.Tensor, scales: torch.Tensor, hints: torch.Tensor,
               points: Sequence[tuple[float, float]], outs) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`margin_marks_at`, on the marks' side stream when there is one and ``outs`` (the stage views) are given:
        forked from the step's stream here, joined by `_join_marks` before the ring write."""
        if self._marks_stream is None or outs is None:
            return margin_marks_at(self.runtime, site, x, scales, hints, points, outs)
        self._marks_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._marks_stream):
            marks = margin_marks_at(self.runtime, site, x, scales, hints, points, outs)
        self._held += [x, scales, hints]  # not freed (nor reused by the step) before the join
        return marks

    def _join_marks(self) -> None:
        """The step's stream waits for the marks' side stream (once per step, before the ring write)."""
        if self._held:
            torch.cuda.current_stream(self.device).wait_stream(self._marks_stream)
            self._held.clear()

    def _route_for(self, layer: int, idx: torch.Tensor) -> torch.Tensor | None:
        """`FP4Runtime` ``route_into``: the stage view (int64 [B, top_k]) the router's sorted ids are written into;
        None before the stage exists or for a shape it was not built for."""
        views = self._views.get(("route", str(layer)))
        if views is None or views[0].dtype != idx.dtype or views[0].shape != idx.shape:
            return None
        self._served_route = layer  # the next `_on_route` of this layer finds its ids in place
        return views[0]

    def _on_route(self, layer: int, idx: torch.Tensor) -> None:
        direct, self._served_route = self._served_route == layer, None
        self._ring_write(("route", str(layer)), (None,) if direct else (idx,))

    def _build_stage(self) -> None:
        """Lay out the stage and the ring from the parts the first step captured, and put that step's values in.
        A part first seen later (an eager decoder whose captures change) is added after the others, and what the
        ring already holds is kept."""
        old_stage, old_ring = self._stage, self._ring
        offset = 0 if old_stage is None else old_stage.numel()
        layout = dict(self._layout)
        for key, parts in self._pending.items():
            layout[key] = []
            for p in parts:
                layout[key].append((offset, tuple(p.shape), p.dtype))
                offset += -(-p.numel() * p.element_size() // 16) * 16  # 16-byte aligned (the kernels' vector stores)
        self._layout = layout
        self._stage = torch.zeros(offset, dtype=torch.uint8, device=self.device)
        self._ring = torch.zeros(self.ring, offset, dtype=torch.uint8, device=self.device)
        if old_stage is not None:
            self._stage[: old_stage.numel()].copy_(old_stage)
            self._ring[:, : old_stage.numel()].copy_(old_ring)
        self._views = {key: [self._stage[o:o + math.prod(shape) * dt.itemsize].view(dt).view(shape)
                             for o, shape, dt in parts] for key, parts in layout.items()}
        for key, parts in self._pending.items():
            for v, p in zip(self._views[key], parts):
                v.copy_(p)
        self._pending = {}

    @property
    def rings(self) -> dict[RingKey, list[torch.Tensor]]:
        """Per capture key, views [ring, B, ...] of each part's column of the ring (empty before the first step)."""
        if self._ring is None:
            return {}
        return {key: [self._ring[:, o:o + math.prod(shape) * dt.itemsize].view(dt).view(self.ring, *shape)
                      for o, shape, dt in parts] for key, parts in self._layout.items()}

    # ---- the step ----------------------------------------------------------------------------------------
    def _forward(self) -> None:
        """One decode step over ``tok`` at ``pos`` / ``col``; writes ``logits`` and advances the state."""
        m = self.model.model
        rt = self.runtime
        b, d, kvh, grp = self.batch, self.head_dim, self.kv_heads, self.groups
        h = m.embed_tokens(self.tok[:, None])  # [B, 1, H]
        cos, sin = m.rotary_emb(h, self.pos[:, None])
        self.valid.index_fill_(1, self.col, True)
        mask = self.valid[:, None, None, :]  # [B, 1, 1, max_len]
        for i, layer in enumerate(m.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_norm(attn.q_proj(x).view(b, 1, -1, d)).transpose(1, 2)  # [B, heads, 1, D]
            k = attn.k_norm(attn.k_proj(x).view(b, 1, -1, d)).transpose(1, 2)  # [B, kv_heads, 1, D]
            v = attn.v_proj(x).view(b, 1, -1, d).transpose(1, 2)
            q, k = self._rope(q, k, cos, sin)
            if self._kv_sites:  # FP4 KV cache, as `qat.fp4_kv_cache` stores it
                k, v = rt.quant_kv(i, k, v)
            self.k[i].index_copy_(2, self.col, k)
            self.v[i].index_copy_(2, self.col, v)
            # Query head j*G + g reads KV head j (HF's repeat_kv order): G queries per KV head.
            o = F.scaled_dot_product_attention(q.reshape(b, kvh, grp, d), self.k[i], self.v[i], attn_mask=mask,
                                               scale=attn.scaling)  # [B, kv_heads, G, D]
            h = h + attn.o_proj(o.reshape(b, 1, kvh * grp * d))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        self.logits = self.model.lm_head(m.norm(h)[:, 0])  # [B, V]
        self._join_marks()
        if self._pending:
            self._build_stage()
        if self._ring is not None:  # one copy per step puts every capture of the step in its ring slot
            self._ring.index_copy_(0, self.slot, self._stage.unsqueeze(0))
        self.pos.add_(1)
        self.col.add_(1)
        self.slot.add_(1).remainder_(self.ring)

    def _step_state(self):
        """The runtime state a step runs (or is traced) in: this decoder's ring callbacks, and the sync-free MoE
        path at any batch (`FP4MoEBlock._routed`: grouped GEMMs with device offsets, or the gather path)."""
        rt = self.runtime
        return rt.using(capture=self._on_capture if self.capture else None,
                        capture_into=self._stage_for if self.capture else None,
                        route_into=self._route_for if self.routes else None,
                        on_route=self._on_route if self.routes else None,
                        gather_max_slots=max(rt.gather_max_slots, self.batch * self.top_k))

    @torch.no_grad()
    def prepare(self, warmup: int = 2) -> None:
        """With ``use_graph``: run the step ``warmup`` times eagerly on a side stream (compiles kernels, fills the
        runtime's weight cache, lays out the capture stage and its ring), then capture it as a CUDA graph (one
        capture at a time in the process). Resets the state after. Eager decoders need no tracing (the stage is
        laid out at their first step)."""
        if self.use_graph:
            with self._step_state(), _CAPTURE_LOCK:
                side = torch.cuda.Stream(self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    for _ in range(warmup):
                        self._forward()
                torch.cuda.current_stream(self.device).wait_stream(side)
                self._graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self._graph, capture_error_mode="thread_local"):
                    self._forward()
        self.reset()
        self._ready = True

    def reset(self) -> None:
        """State at column 0 with no valid KV column (stale K/V and ring values stay, masked / overwritten)."""
        self.valid.zero_()
        for t in (self.tok, self.pos, self.col, self.slot):
            t.zero_()

    @torch.no_grad()
    def load_prefill(self, cache, attention_mask: torch.Tensor, prompt_lens: torch.Tensor) -> None:
        """Copy a prefill's `DynamicCache` (left-padded ``[B, P]``) into the static cache; the next step is
        column P, row b at position ``prompt_lens[b]`` (int64 [B] on the device)."""
        p = attention_mask.shape[1]
        if p >= self.max_len:
            raise ConfigError(f"prompt columns {p} leave no room in max_len={self.max_len}")
        for i in range(self.num_layers):
            k, v = _cache_layer(cache, i)
            self.k[i][:, :, :p].copy_(k)
            self.v[i][:, :, :p].copy_(v)
        self.valid.zero_()
        self.valid[:, :p].copy_(attention_mask.bool())
        self.col.fill_(p)
        self.pos.copy_(prompt_lens)
        self.slot.zero_()

    @torch.no_grad()
    def step(self, tok: torch.Tensor) -> torch.Tensor:
        """Feed ``tok`` (int64 [B], on the device) and return the logits [B, V] (valid until the next step)."""
        if not self._ready:
            raise ConfigError("StaticDecoder.step before prepare()")
        self.tok.copy_(tok)
        if self._graph is not None:
            self._graph.replay()
        else:
            with self._step_state():
                self._forward()
        return self.logits

    def take(self, n: int) -> dict[RingKey, list[torch.Tensor]]:
        """Copies of the first ``n`` ring slots, each ``[n * B, ...]`` (row = step * B + batch row), in the
        order the steps ran since the ring was last taken. Call after every ``ring`` steps and at the end. Every
        part is uint8 (the routes' int64 ids, < 256 experts, as uint8)."""
        if not 0 <= n <= self.ring:
            raise ConfigError(f"take({n}): the ring holds {self.ring} steps")
        # copy first: a part's ring column is strided (or, alone in the stage, the ring itself)
        return {key: [(b[:n].clone() if b.dtype == torch.uint8 else b[:n].to(torch.uint8)).reshape(
                    n * self.batch, *b.shape[2:]) for b in bufs]
                for key, bufs in self.rings.items()}
