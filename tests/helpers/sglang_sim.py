"""An SGLang-shaped driver of the plugin's real hooks (`tracerl.sglang.hooks`), fed by our reference engine.

SGLang's CUDA stack cannot run here, so the parts of SGLang around the hooks are stood in for, as SGLang 0.5.23
lays them out: a KV-slot allocator (slot 0 reserved, as SGLang's padding slot) with prefix-cache hits that reuse a
donor request's slots, chunked prefill, decode forwards padded to CUDA-graph batch sizes, the MoE input's codes
uint8 [T, H/2] and scales float8_e4m3fn [T, H/16] in the layouts SGLang's TRT-LLM path hands to
``quantize_hidden_states_fp4``'s caller (hidden sizes padded, or FP4 delivered by a dispatcher with 128x4-swizzled
scales), SGLang's result copy (``map_device_tensors`` then ``finalize``, one forward late as under the overlap
scheduler), its routed-experts host cache by KV slot, and finished / aborted ``Req`` objects. The codes and
scales are those our reference engine computed for each (request, position) (`RolloutEngine` with
``keep_codes``), so the store the hooks write can be compared with the reference recorder's, row for row.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import torch

from helpers.sglang import swizzle_128x4
from tracerl.sglang import hooks
from tracerl.sglang.capture import SlotCapture
from tracerl.sglang.quantizer import reciprocal_f32

VARIANTS = ("linear", "padded", "dispatched")


class FinishReason:
    """SGLang's ``BaseFinishReason``: ``to_json()["type"]`` is ``stop``, ``length`` or ``abort``."""

    def __init__(self, kind: str):
        self.kind = kind

    def to_json(self) -> dict:
        return {"type": self.kind}


@dataclasses.dataclass
class Request:
    """One request of the reference run, with the attributes of SGLang's ``Req`` the hooks read."""

    rid: str
    origin_input_ids: list[int]
    response: list[int]
    logprobs: list[float]
    codes: dict[str, np.ndarray]  # site -> uint8 [P + G - 1, W/2]
    scales: dict[str, np.ndarray]  # site -> uint8 [P + G - 1, W/16]
    experts: dict[int, np.ndarray]  # layer -> uint8 [P + G - 1, top_k]
    arrive: int = 0  # forward at which it arrives
    abort_after: int | None = None  # aborted once this many output tokens were sampled
    donor: str | None = None  # prefix-cache hit on this request's prompt
    output_ids: list[int] = dataclasses.field(default_factory=list)
    finished_reason: FinishReason | None = None
    req_pool_idx: int = 0

    @property
    def output_ids_through_stop(self) -> list[int]:
        return self.output_ids

    @property
    def kv(self):
        return SimpleNamespace(req_pool_idx=self.req_pool_idx)

    @property
    def logprob(self):
        return SimpleNamespace(output_token_logprobs_val=self.logprobs[: len(self.output_ids)])

    @property
    def sampling_params(self):
        return SimpleNamespace(custom_params=None)

    weight_version_events = ()


class Routes:
    """Stand-in of SGLang's routed-experts capturer: int32 [KV slots, layers, top_k] host cache, ``get_topk``."""

    def __init__(self, num_slots: int, num_layers: int, top_k: int):
        self.host = np.zeros((num_slots, num_layers, top_k), dtype=np.int32)

    def get_topk(self, req_pool_idx, seqlen, req_to_token_pool, start_len=0):
        slots = req_to_token_pool.req_to_token[req_pool_idx][start_len: seqlen - 1].numpy()
        return self.host[slots]


class Driver:
    """Runs ``requests`` through the hooks on ``state`` (its session open): continuous batching of at most
    ``chunk`` prefill tokens per forward, decode forwards padded to powers of two, one forward of result-copy
    delay. ``global_scales``: {site: g} the reference engine quantized with (SGLang's multiplier is fp32(1/g))."""

    def __init__(self, state: hooks.State, requests: list[Request], layer_sites: dict[int, str], width: int,
                 global_scales: dict[str, float], *, num_layers: int, top_k: int, chunk: int = 7,
                 num_slots: int = 1024, seed: int = 0):
        self.st, self.reqs, self.layer_sites, self.width = state, requests, layer_sites, width
        self.by_rid = {r.rid: r for r in requests}
        self.chunk = chunk
        self.mult = {s: torch.tensor(reciprocal_f32(global_scales[s]), dtype=torch.float32)
                     for s in layer_sites.values()}
        state.capture = SlotCapture(layer_sites, width, max_rows=64, num_slots=num_slots)
        self.routes = Routes(num_slots, num_layers, top_k)
        state.routes = lambda: self.routes
        state.spans = lambda req: [("default", 0, len(req.output_ids))]
        max_len = max(len(r.origin_input_ids) + len(r.response) for r in requests)
        self.pool = SimpleNamespace(req_to_token=torch.zeros(len(requests) + 1, max_len, dtype=torch.int64))
        self.processor = SimpleNamespace(req_to_token_pool=self.pool)
        self.next_slot = 1  # slot 0: SGLang's padding slot
        self.rng = np.random.default_rng(seed)
        self.forwards = 0
        self.variant_counts = dict.fromkeys(VARIANTS, 0)
        self.padded_rows = 0
        self.prefill_splits = 0

    # ---- KV slots -----------------------------------------------------------------------------------------
    def _slot(self, r: Request, pos: int) -> int:
        s = self.next_slot
        self.next_slot += 1
        self.pool.req_to_token[r.req_pool_idx, pos] = s
        return s

    # ---- one forward ----------------------------------------------------------------------------------------
    def _forward(self, rows: list[tuple[Request, int]], pad: int):
        """One model forward over ``rows`` (request, position) plus ``pad`` CUDA-graph padding rows: every hinted
        MoE layer's ``apply`` -> ``quantize_hidden_states_fp4`` (or a dispatcher's FP4), then SGLang's result
        object with our capture chained in."""
        loc = torch.tensor([self._slot(r, p) for r, p in rows], dtype=torch.int64)
        for (r, p), s in zip(rows, loc.tolist()):
            for layer, e in r.experts.items():
                self.routes.host[s, layer] = e[p]
        variant = VARIANTS[self.forwards % len(VARIANTS)]
        self.variant_counts[variant] += 1
        self.forwards += 1
        t = len(rows) + pad
        extra = 16 if variant == "padded" else 0  # TRT-LLM's padded hidden size (zeros there in SGLang; junk here)

        def site_tensors(site):
            codes = np.concatenate([np.stack([r.codes[site][p] for r, p in rows]),
                                    self.rng.integers(0, 256, (pad, self.width // 2), dtype=np.uint8)])
            scales = np.concatenate([np.stack([r.scales[site][p] for r, p in rows]),
                                     self.rng.integers(0, 126, (pad, self.width // 16), dtype=np.uint8)])
            if extra:
                codes = np.concatenate([codes, self.rng.integers(0, 256, (t, extra // 2), dtype=np.uint8)], 1)
                scales = np.concatenate([scales, self.rng.integers(0, 126, (t, extra // 16), dtype=np.uint8)], 1)
            return torch.from_numpy(codes), torch.from_numpy(scales)

        def model_forward(runner, forward_batch):
            for layer_id, site in self.layer_sites.items():
                codes, scales = site_tensors(site)
                m = self.mult[site]
                layer = SimpleNamespace(layer_id=layer_id, w13_input_scale_quant=m)
                if variant == "dispatched":
                    do = SimpleNamespace(hidden_states=codes,
                                         hidden_states_scale=torch.from_numpy(swizzle_128x4(scales.numpy())))
                else:
                    do = SimpleNamespace(hidden_states=torch.zeros(t, self.width), hidden_states_scale=None)

                def apply(method, layer, dispatch_output, codes=codes, scales=scales, m=m):
                    if dispatch_output.hidden_states_scale is None:  # the TRT-LLM path quantizes in Python
                        result = (codes, scales.view(torch.float8_e4m3fn))
                        hooks.after_quantize_hidden_states_fp4(result, dispatch_output.hidden_states, m)
                    return SimpleNamespace(hidden_states=None)

                hooks.around_apply(apply, SimpleNamespace(), layer=layer, dispatch_output=do)
            return SimpleNamespace(routed_experts_output=None, logits_output=None)

        runner = SimpleNamespace(is_draft_worker=False)
        out = hooks.around_forward(model_forward, runner, SimpleNamespace(out_cache_loc=loc, out_cache_loc_virtual=None))
        out.routed_experts_output.map_device_tensors(lambda x: x.clone())  # SGLang's async device -> host copy
        return out

    # ---- the schedule ----------------------------------------------------------------------------------------
    def run(self) -> None:
        waiting: list[tuple[Request, int]] = []  # (request, next prompt position to prefill)
        running: list[Request] = []
        step = 0
        for i, r in enumerate(self.reqs):
            r.req_pool_idx = i + 1
        while True:
            for r in self.reqs:
                if r.arrive == step:
                    start = 0
                    if r.donor is not None:  # prefix-cache hit: all but the last prompt token are cached
                        d = self.by_rid[r.donor]
                        start = len(r.origin_input_ids) - 1
                        self.pool.req_to_token[r.req_pool_idx, :start] = self.pool.req_to_token[d.req_pool_idx, :start]
                    waiting.append((r, start))
            if not waiting and not running and all(r.arrive < step for r in self.reqs):
                break
            if waiting:
                rows, budget, sampled = [], self.chunk, []
                while waiting and budget:
                    r, start = waiting[0]
                    n = min(budget, len(r.origin_input_ids) - start)
                    rows += [(r, p) for p in range(start, start + n)]
                    budget -= n
                    if start + n == len(r.origin_input_ids):
                        waiting.pop(0)
                        sampled.append(r)
                    else:
                        waiting[0] = (r, start + n)
                        self.prefill_splits += 1
                batch = sampled
                out = self._forward(rows, 0)
            elif running:
                rows = [(r, len(r.origin_input_ids) + len(r.output_ids) - 1) for r in running]
                pad = (1 << (len(rows) - 1).bit_length()) - len(rows)
                self.padded_rows += pad
                batch = list(running)
                out = self._forward(rows, pad)
            else:
                step += 1
                continue
            out.routed_experts_output.finalize()  # process_batch_result: finalize, then the finished requests
            self._process(batch, running)
            step += 1

    def _process(self, batch: list[Request], running: list[Request]) -> None:
        finished = []
        for r in batch:
            r.output_ids.append(r.response[len(r.output_ids)])
            if r not in running:
                running.append(r)
            if r.abort_after is not None and len(r.output_ids) >= r.abort_after:
                r.finished_reason = FinishReason("abort")
            elif len(r.output_ids) == len(r.response):
                r.finished_reason = FinishReason("length")
            if r.finished_reason is not None:
                finished.append(r)
                hooks.after_collect_routed_experts(None, self.processor, r)
        hooks.around_process_batch_result(lambda *a: None, self.processor, batch, None)
        for r in finished:
            running.remove(r)
