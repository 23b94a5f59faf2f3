"""NVFP4 fake quantization of Hugging Face MoE models at named sites: one runtime for rollout and trainer.

`install_fp4(model, plan)` swaps each sparse MoE block for `FP4MoEBlock` (and, for the attention placement,
each attention projection for `FP4Linear`) and returns the `FP4Runtime` that every swapped module consults.
The runtime's ``mode`` decides what a site does:

| mode | FP4 sites (activations) | hinted sites | expert weights |
| --- | --- | --- | --- |
| ``bf16`` | identity | identity | bf16 |
| ``fp4_rne_own_scales`` | RNE, own block scales | RNE, own block scales | NVFP4 (STE) |
| ``fp4_rne_rollout_scales`` | RNE, own scales | RNE with the rollout's block scales | NVFP4 (STE) |
| ``fp4_hints`` | RNE, own scales | hint-guided rounding with the rollout's scales | NVFP4 (STE) |

The rollout runs ``fp4_rne_own_scales`` with a ``capture`` callback: at hinted sites the runtime calls
``tracefp4.quantize_fake`` (one pass: the fake-quantized output and the codes, hints, scales) and hands the
quantized result to the callback, so what is recorded is
exactly what the rollout's forward used. Per-site global scales are static (calibrated once, stored in the
store's model metadata) so rollout and trainer divide by the same fp32 ``g``.

All numerics are `tracefp4`'s (`quantize_fake`, `fake_quantize`); gradients are straight-through.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import tracefp4
from tracefp4.constants import HINTS_PER_BYTE
from tracerl.config import QAT_MODES, SCALE_ENCODINGS
from tracerl.errors import ConfigError, HintMismatchError
from tracerl.policy.experts import grouped_gemm_supported, grouped_gemm_sync_free, routed_experts
from tracerl.policy.models import moe_blocks
from tracerl.policy.sites import BLOCK, SitePlan, kv_cache_sites, linear_input_site, moe_down_site, moe_input_site
from tracerl.util import swapped

MODES = QAT_MODES  # defined in tracerl.config, which the command line imports without torch

CaptureFn = Callable[[str, Any], None]  # (site, tracefp4.quantize result [N, W]) at hinted sites
ObserveFn = Callable[[str, torch.Tensor, torch.Tensor], None]  # (site, codes_u8 [N, W], scale_e4m3 [N, W/16])
RouteFn = Callable[[int, torch.Tensor], None]  # (layer, expert ids [N, top_k], ascending per row)
# (site, activation x [N, W]) -> the site's quantized output [N, W] in x's dtype, or None for the mode's own
SubstituteFn = Callable[[str, torch.Tensor], "torch.Tensor | None"]


def check_mode(mode: str) -> None:
    """Raise `ConfigError` unless ``mode`` is one of `MODES`."""
    if mode not in MODES:
        raise ConfigError(f"unknown QAT mode {mode!r}; supported: {', '.join(MODES)}")


class _StraightThrough(torch.autograd.Function):
    """Forward: the precomputed quantized value; backward: the identity (STE)."""

    @staticmethod
    def forward(ctx, x_hp: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # noqa: ARG004
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def effective_codes(y: torch.Tensor, scale_e4m3: torch.Tensor, global_scale: torch.Tensor,
                    backend: str = "auto") -> torch.Tensor:
    """E2M1 codes (uint8 [N, W]) that a fake-quantized ``y`` [N, W] carries, given its scales [N, W/16] and ``g``:
    `tracefp4.effective_codes` (one Triton pass on a GPU; the exact rule in `tracefp4.reference.nvfp4_codes_ref`).
    A hot path: every hinted site of every forward that measures code agreement."""
    return tracefp4.effective_codes(y, scale_e4m3, global_scale, backend=backend)


class _CallState(threading.local):
    """`FP4Runtime`'s per-call state, one copy per thread, each starting from the runtime's defaults."""

    def __init__(self, defaults: dict[str, Any]):
        self.__dict__.update({k: dict(v) if isinstance(v, dict) else v for k, v in defaults.items()})


def _call_state_property(name: str) -> property:
    def get(self: FP4Runtime) -> Any:
        return getattr(self._state, name)

    def put(self: FP4Runtime, value: Any) -> None:
        setattr(self._state, name, value)

    return property(get, put, doc=f"``{name}`` of the calling thread (see `FP4Runtime.CALL_STATE`)")


class FP4Runtime:
    """State shared by every FP4 module of one model: mode, global scales, callbacks, provided hints.

    The per-call state (`CALL_STATE`: mode, callbacks, provided hints, forced routes, ...) is per thread: each
    thread starts from the runtime's defaults (the construction values, and the mode of the last `set_mode`) and
    its assignments, `using` blocks and `provide` calls change only what that thread sees. Two threads can
    therefore run the same model in different modes at once (`tracerl.audit` decodes the replay and the bf16
    floor side by side on two CUDA streams). Global scales, the weight cache and calibration are shared.
    """

    #: the per-call state that `using` sets and restores (per thread)
    CALL_STATE = ("mode", "capture", "capture_into", "observe", "on_route", "route_into", "provided",
                  "forced_routes", "gather_max_slots", "substitute")

    def __init__(self, plan: SitePlan, global_scales: Mapping[str, float] | None = None, *, backend: str = "auto"):
        self.plan = plan
        self.backend = backend
        self._fp4 = {s.name for s in plan.sites}
        self._hinted = set(plan.hinted)
        self._defaults: dict[str, Any] = {
            "mode": "fp4_rne_own_scales",
            "capture": None,  # CaptureFn | None
            # (site, x [N, W]) -> (scales_out [N, W/16], hints_out [N, W/8]), a decoder's stage buffers for the
            # capture to be written into, optionally followed by ((value marks [N, W/8], block marks [N,
            # ceil(W/128)]), (margin, scale margin)) for the site's margin marks too (tracefp4.quantize_fake
            # ``marks``); or None: fresh tensors
            "capture_into": None,
            "observe": None,  # ObserveFn | None
            "on_route": None,  # RouteFn | None
            # (layer, router ids [N, top_k] int64) -> an int64 [N, top_k] tensor (a decoder's stage view) that the
            # sort of the ids writes into before ``on_route`` gets it, or None: a fresh tensor
            "route_into": None,
            "provided": {},  # {site: (scale_e4m3, hints | None)} for the rows of the next forward
            # Routing replay: {layer: expert ids [N, top_k] (int64, forward rows)} that MoE blocks use instead of
            # their router's top-k (the router's probabilities still weight them, so the gate gets gradients).
            "forced_routes": {},
            # MoE calls on CUDA with at most this many (token, expert) slots take a path without host syncs:
            # grouped GEMMs where they run sync-free, else the gather/bmm path (`FP4MoEBlock._routed`).
            "gather_max_slots": 64,
            # A per-site override of the FP4 modes (tracerl.audit: exact replacement by the rollout's values, hints
            # at sites the plan does not hint); consulted at every FP4 activation site in every mode but bf16.
            "substitute": None,  # SubstituteFn | None
        }
        self._state = _CallState(self._defaults)
        self.global_scales: dict[str, torch.Tensor] = {}
        if global_scales is not None:
            self.set_global_scales(global_scales)
        self._calib: dict[str, torch.Tensor] | None = None
        self._wcache: dict[str, tuple[int, int, int, torch.Tensor]] = {}
        self._weights_generation = 0  # bumped by `weights_changed`: part of every cached weight's stamp
        # {key: the tensor `weight` last quantized for it}: what `prequantize_weights` quantizes ahead of a forward
        self._wsrc: dict[str, torch.Tensor] = {}
        #: keep fake-quantized weights between forwards (`weight`); off, each forward quantizes them anew
        self.cache_weights = True
        # Device copies of the (host) global scales: {(site, device): (host tensor, its version, device copy)}.
        self._gdev: dict[tuple[str, torch.device], tuple[torch.Tensor, int, torch.Tensor]] = {}
        #: {hinted site: "lsb"} for sites whose provided scale rows are scale hints (`set_scale_encodings`);
        #: every other site's provided rows are E4M3 bytes
        self.scale_encodings: dict[str, str] = {}

    mode = _call_state_property("mode")
    capture = _call_state_property("capture")
    capture_into = _call_state_property("capture_into")
    observe = _call_state_property("observe")
    on_route = _call_state_property("on_route")
    route_into = _call_state_property("route_into")
    provided = _call_state_property("provided")
    forced_routes = _call_state_property("forced_routes")
    gather_max_slots = _call_state_property("gather_max_slots")
    substitute = _call_state_property("substitute")

    # ---- configuration -------------------------------------------------------------------------------
    def set_mode(self, mode: str) -> None:
        """Switch the mode for good (`using` switches it for a block). Raises `ConfigError` for an unknown mode."""
        check_mode(mode)
        self._defaults["mode"] = mode  # threads that have not run yet start in it
        self.mode = mode

    def set_global_scales(self, scales: Mapping[str, float]) -> None:
        missing = sorted(self._fp4 - set(scales))
        if missing:
            raise ConfigError(f"global scales missing for FP4 sites {missing[:4]}{'...' if len(missing) > 4 else ''}")
        # float -> fp32 is exact for values that came from an fp32 (JSON keeps doubles exactly).
        self.global_scales = {k: torch.tensor(float(v), dtype=torch.float32) for k, v in scales.items()}

    def set_scale_encodings(self, encodings: Mapping[str, str]) -> None:
        """What the provided scale rows of each hinted site are (the store's scale encoding, FORMAT §2.4):
        ``"bytes"`` (the default), E4M3 bytes [N, W/16]; ``"lsb"``, scale hints [N, ceil(W/128)] from which
        `quant` reconstructs the rollout's bytes with this forward's own activations in the same pass as its
        hint-guided rounding (`tracefp4.fake_quantize_lsb`; the rule of `tracerl.hints.reconstruct_scales`).
        `tracerl.hints.use_store_scale_encodings(runtime, store)` sets them from a store.

        Raises `ConfigError` (nothing changes) for a site the plan does not hint or an unknown encoding."""
        bad = {s: e for s, e in encodings.items() if e not in SCALE_ENCODINGS}
        foreign = sorted(set(encodings) - self._hinted)
        if bad or foreign:
            raise ConfigError(f"scale encodings: {f'unknown {bad} (supported: bytes, lsb)' if bad else ''}"
                              f"{'; ' if bad and foreign else ''}"
                              f"{f'sites {foreign[:4]} are not hinted by the plan' if foreign else ''}")
        self.scale_encodings = {s: e for s, e in encodings.items() if e != "bytes"}

    def global_scales_json(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.global_scales.items()}

    @contextlib.contextmanager
    def using(self, **state: Any) -> Iterator[FP4Runtime]:
        """Set per-call state (any of `CALL_STATE`: ``mode``, the ``capture`` / ``observe`` / ``on_route``
        callbacks, ``capture_into``, ``route_into``, ``provided`` hints and scales, ``forced_routes``,
        ``gather_max_slots``, ``substitute``) for the block; the previous values come back on exit, also when the
        block raises.

        Raises `ConfigError` for an unknown key or mode, before anything changes."""
        unknown = sorted(set(state) - set(self.CALL_STATE))
        if unknown:
            raise ConfigError(f"FP4Runtime.using: unknown state {unknown}; settable: {', '.join(self.CALL_STATE)}")
        if "mode" in state:
            check_mode(state["mode"])
        with swapped(self, **state):
            yield self

    @contextlib.contextmanager
    def calibrating(self) -> Iterator[None]:
        """Run forwards in bf16 and record each FP4 site's amax over finite values; on exit each site's global
        scale is `tracefp4.compute_global_scale` of its amax (max(amax / 2688, 2^-118); 1.0 for amax 0)."""
        with self.using(mode="bf16"), swapped(self, _calib={}):
            yield
            missing = sorted(self._fp4 - set(self._calib))
            if missing:
                raise ConfigError(f"calibration saw no activations at sites {missing[:4]}")
            # g of the running amax equals g of every calibration activation at once: the formula only reads amax.
            self.global_scales = {k: tracefp4.compute_global_scale(a).cpu() for k, a in self._calib.items()}

    def provide(self, site_data: Mapping[str, tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        """Hinted sites' (scale_e4m3 [N, W/16], hints [N, W/8]) for the rows of the next forward."""
        self.provided = dict(site_data)

    def global_scale_on(self, site: str, device: torch.device) -> torch.Tensor:
        """``site``'s fp32 global scale on ``device``, copied there once (not per forward).

        The scales live on the host (JSON in, JSON out); ``g.to(cuda)`` in every forward was a blocking
        host-to-device copy, i.e. one host sync per FP4 site per forward. The copy is cached per device and
        refreshed when the host tensor is replaced (`set_global_scales`, `calibrating`) or written in place."""
        src = self.global_scales[site]
        if src.device == device:
            return src
        key = (site, device)
        hit = self._gdev.get(key)
        if hit is None or hit[0] is not src or hit[1] != src._version:
            # Pageable host -> device with non_blocking: the driver stages the 4 bytes at once, no host sync.
            hit = (src, src._version, src.to(device, non_blocking=True))
            self._gdev[key] = hit
        return hit[2]

    # ---- the quantization points ---------------------------------------------------------------------
    def quant(self, site: str, x: torch.Tensor) -> torch.Tensor:
        """Quantize activation ``x`` [N, W] at ``site`` per the mode; returns [N, W] in x's dtype."""
        if self._calib is not None:
            # finite values only, as `tracefp4.compute_global_scale` counts them
            amax = x.detach().float().abs().nan_to_num(nan=0.0, posinf=0.0).amax()
            prev = self._calib.get(site)
            self._calib[site] = amax if prev is None else torch.maximum(prev, amax)
        if self.mode == "bf16" or site not in self._fp4:
            return x
        if self.substitute is not None:
            y = self.substitute(site, x)
            if y is not None:
                return y
        g = self.global_scale_on(site, x.device)
        hinted = site in self._hinted
        if hinted and self.mode in ("fp4_rne_rollout_scales", "fp4_hints"):
            if site not in self.provided:
                raise HintMismatchError(f"mode {self.mode} needs the rollout's scales for hinted site {site}")
            scale_e4m3, hints = self.provided[site]
            n, w = x.shape
            lsb = self.scale_encodings.get(site) == "lsb"
            nscale = -(-w // (8 * BLOCK)) if lsb else w // BLOCK
            if scale_e4m3.shape != (n, nscale) or (hints is not None and hints.shape != (n, w // HINTS_PER_BYTE)):
                raise HintMismatchError(
                    f"site {site}: activation [{n}, {w}] needs {'scale hints' if lsb else 'scales'} [{n}, {nscale}] "
                    f"and hints [{n}, {w // HINTS_PER_BYTE}], got {tuple(scale_e4m3.shape)} and "
                    f"{None if hints is None else tuple(hints.shape)}"
                )
            use = hints if self.mode == "fp4_hints" else None
            if lsb:  # the rollout's bytes rebuilt and the rounding in one pass over x
                y, scale_e4m3 = tracefp4.fake_quantize_lsb(x, g, scale_e4m3, hints=use, backend=self.backend)
            else:
                y = tracefp4.fake_quantize(x, fmt="nvfp4", global_scale=g, scales=scale_e4m3, hints=use,
                                           backend=self.backend)
            if self.observe is not None:
                self.observe(site, effective_codes(y.detach(), scale_e4m3, g, self.backend), scale_e4m3)
            return y
        if hinted and (self.capture is not None or self.observe is not None):
            # one pass over x: the fake-quantized activation and the codes/scales/hints the rollout records
            # (tracefp4.quantize_fake: y equals fake_quantize(x) and q equals quantize(x), bit for bit)
            into = self.capture_into(site, x) if self.capture is not None and self.capture_into is not None else None
            outs = {} if into is None else {"scales_out": into[0], "hints_out": into[1]}
            if into is not None and len(into) == 4:  # and the margin marks at (margin, scale margin) into[3]
                outs.update(marks_out=into[2], marks=into[3])
            y, q = tracefp4.quantize_fake(x, "nvfp4", global_scale=g, backend=self.backend, **outs)
            if self.capture is not None:
                self.capture(site, q)
            if self.observe is not None:
                self.observe(site, tracefp4.unpack_codes(q.codes), q.scales)
            return y
        return tracefp4.fake_quantize(x, fmt="nvfp4", global_scale=g, backend=self.backend)

    def quant_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [..., head_dim] as the FP4 KV cache of ``layer`` stores them (`quant` at its
        ``k_cache`` / ``v_cache`` sites, rows along head_dim); same shapes and dtype back."""
        k_site, v_site = kv_cache_sites(layer)
        d = k.shape[-1]
        return (self.quant(k_site, k.reshape(-1, d)).reshape(k.shape),
                self.quant(v_site, v.reshape(-1, v.shape[-1])).reshape(v.shape))

    def weights_changed(self) -> None:
        """Forget every cached fake-quantized weight (`weight`): call it whenever the weights change by a route the
        cache's stamp (a tensor's version counter and storage) cannot see — an optimizer step into FSDP2's shards,
        which the next all-gather writes into the same unsharded storage, or another version's weights swapped in."""
        self._weights_generation += 1
        self._wcache.clear()

    def weight(self, key: str, w_hp: torch.Tensor) -> torch.Tensor:
        """NVFP4 fake-quantized weight (per-matrix dynamic global scale), cached until the parameter changes (its
        version counter or storage, or a `weights_changed` call)."""
        if self.mode == "bf16" or not self.plan.fp4_weights:
            return w_hp
        wq, _ = self._fake_quantized(key, w_hp)
        if w_hp.requires_grad and torch.is_grad_enabled():
            return _StraightThrough.apply(w_hp, wq)
        return wq

    def _fake_quantized(self, key: str, w_hp: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """(``w_hp`` fake-quantized, whether it was computed now): from the cache while its stamp (version counter,
        storage, `weights_changed` generation) holds, else computed and, with ``cache_weights``, cached."""
        stamp = (w_hp._version, w_hp.data_ptr(), self._weights_generation)
        hit = self._wcache.get(key)
        if hit is not None and hit[:3] == stamp:
            return hit[3], False
        # each matrix ([E, out, in]: each expert's) with its own dynamic global scale, the whole stack in one
        # reduction and one launch (a launch and a reduction per matrix were 2,560 of each per forward of the
        # H200 model, 0.1-0.2 ms of host time apiece)
        wq = tracefp4.fake_quantize_matrices(w_hp.detach(), backend=self.backend)
        if self.cache_weights:
            self._wcache[key] = (*stamp, wq)
            self._wsrc[key] = w_hp
        return wq, True

    def prequantize_weights(self) -> int:
        """Fake-quantize now, into the cache, every weight `weight` has cached before (by key, from the tensor it
        last saw, in the order it met them), so that the next forward finds them there: the same tensors and bits
        as `weight` would compute then. Call it right after an optimizer step (and `weights_changed`), while the
        device still runs the optimizer: the host's launches (three per expert stack, ~0.3 ms of host time each;
        80 stacks in the H200 model) then overlap that device work instead of holding up a host-bound forward.

        Returns how many weights were quantized; 0 (nothing done) in bf16 mode, without FP4 weights, or with
        ``cache_weights`` off (sharded training: the all-gathered weights exist only inside a forward); a tensor
        whose storage has been freed since (FSDP2 reshards its unsharded weights after the backward) is skipped."""
        if self.mode == "bf16" or not self.plan.fp4_weights or not self.cache_weights:
            return 0
        n = 0
        for key, w_hp in list(self._wsrc.items()):
            if w_hp.untyped_storage().nbytes() < (w_hp.storage_offset() + w_hp.numel()) * w_hp.element_size():
                continue  # storage freed since (FSDP2's unsharded weights after a reshard): the forward will see
            n += self._fake_quantized(key, w_hp)[1]
        return n


class FP4MoEBlock(nn.Module):
    """A sparse MoE block with NVFP4 routed experts; router (and shared expert, if any) stay bf16.

    Keeps the original block's parameters (same names under ``gate``, ``experts``, ``shared_expert``), so
    state dicts are unchanged.
    """

    def __init__(self, block: nn.Module, layer: int, module_name: str, runtime: FP4Runtime):
        super().__init__()
        self.gate = block.gate
        self.experts = block.experts
        self.shared_expert = getattr(block, "shared_expert", None)
        self.shared_expert_gate = getattr(block, "shared_expert_gate", None)
        self.layer = layer
        self.module_name = module_name
        self.runtime = runtime
        self.input_site = moe_input_site(layer)
        self.down_site = moe_down_site(layer)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        bsz, seq, hidden = hidden_states.shape
        rt = self.runtime
        x = hidden_states.reshape(-1, hidden)  # (N, H), N = B*T
        logits, weights, idx = self.gate(x)  # router in bf16 on the unquantized input; (N, k) each
        # Ascending expert id per token: the down-input site's slot order, and order-free routing records.
        into = rt.route_into(self.layer, idx) if rt.on_route is not None and rt.route_into is not None else None
        if into is None:
            idx, perm = idx.sort(dim=-1)
        else:  # sorted straight into the caller's buffer (a decoder's capture stage: no copy of its own)
            perm = torch.empty_like(idx)
            torch.sort(idx, dim=-1, out=(into, perm))
            idx = into
        weights = weights.gather(-1, perm)
        if rt.on_route is not None:
            rt.on_route(self.layer, idx)  # the router's own choice (also under routing replay)
        forced = rt.forced_routes.get(self.layer)
        if forced is not None:  # routing replay: the rollout's experts, weighted by this router's probabilities
            if forced.shape != idx.shape:
                raise HintMismatchError(f"layer {self.layer}: replayed routes {tuple(forced.shape)} for a forward "
                                        f"of {tuple(idx.shape)} (tokens, top_k)")
            idx = forced.to(device=idx.device, dtype=idx.dtype)  # ascending, as recorded
            probs = torch.softmax(logits.float(), dim=-1).gather(-1, idx)
            if getattr(self.gate, "norm_topk_prob", True):
                probs = probs / probs.sum(dim=-1, keepdim=True)
            weights = probs.to(weights.dtype)
        out = self._routed(rt.quant(self.input_site, x), idx, weights)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out.reshape(bsz, seq, hidden)

    def _routed(self, x_q: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        rt = self.runtime
        ex = self.experts
        n, k = idx.shape
        w_gate_up = rt.weight(f"{self.module_name}.experts.gate_up_proj", ex.gate_up_proj)  # (E, 2I, H)
        w_down = rt.weight(f"{self.module_name}.experts.down_proj", ex.down_proj)  # (E, H, I)
        # Decode calls on a device (CUDA; meta in the no-sync tests) must not sync with the host (a CUDA graph
        # captures them): the grouped GEMMs where they run sync-free (bf16 on Hopper: each used expert's weights
        # are read once), else the gather path (each slot gathers its expert's weights: 3x the weight bytes).
        if x_q.device.type != "cpu" and n * k <= rt.gather_max_slots and not (
                grouped_gemm_supported(x_q, w_gate_up) and grouped_gemm_sync_free(x_q.device)):
            return self._routed_gather(x_q, idx, weights, w_gate_up, w_down)
        # Grouped per-expert GEMMs with a backward that is deterministic by construction (`tracerl.policy.experts`:
        # gathers, permutations and a fixed-order fp32 sum of each token's k slots instead of index-put
        # accumulation), whose forward is the same computation as the plain grouped path, bit for bit. Back in slot
        # order the k slots are summed in a fixed order (``index_add`` on CUDA adds with atomics in whatever order
        # the threads arrive: two identical forwards differed in the last bf16 bit, which 40 layers amplify into
        # different FP4 codes), the same reduction as the decode path's.
        return routed_experts(x_q, idx, weights, w_gate_up, w_down, ex.act_fn,
                              down_quant=lambda h: rt.quant(self.down_site, h))

    def _routed_gather(self, x_q, idx, weights, w_gate_up, w_down) -> torch.Tensor:
        """Decode path: gather each slot's expert weights and run batched GEMVs (no host sync, few launches).

        Serving engines decode MoE layers this way (or with fused kernels) rather than with the grouped
        per-expert GEMMs a trainer uses, so the two paths round differently, as they do in production.
        """
        rt = self.runtime
        n, k = idx.shape
        flat = idx.reshape(-1)  # (N*k,)
        xs = x_q.repeat_interleave(k, dim=0).unsqueeze(-1)  # (N*k, H, 1)
        gate, up = torch.bmm(w_gate_up.index_select(0, flat), xs).squeeze(-1).chunk(2, dim=-1)  # (N*k, I) each
        h = self.experts.act_fn(gate) * up
        inter = h.shape[-1]
        h_q = rt.quant(self.down_site, h.reshape(n, k * inter)).reshape(n * k, inter, 1)
        y = torch.bmm(w_down.index_select(0, flat), h_q).squeeze(-1)  # (N*k, H)
        y = y * weights.reshape(-1, 1).to(y.dtype)
        return y.reshape(n, k, -1).sum(dim=1).to(x_q.dtype)


class FP4Linear(nn.Module):
    """nn.Linear with NVFP4 input (site ``{module}.input``) and weight; keeps the wrapped module's parameters."""

    def __init__(self, linear: nn.Linear, module_name: str, runtime: FP4Runtime):
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.module_name = module_name
        self.site = linear_input_site(module_name)
        self.runtime = runtime

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_q = self.runtime.quant(self.site, x.reshape(-1, self.in_features)).reshape(x.shape)
        return F.linear(x_q, self.runtime.weight(self.module_name, self.weight), self.bias)


def fp4_kv_cache(model: nn.Module, runtime: FP4Runtime):
    """A `DynamicCache` that fake-quantizes keys and values (NVFP4 along head_dim) as they are stored, at the
    plan's ``...self_attn.{k,v}_cache`` sites; None when the plan has no KV sites. A full-sequence forward that
    is given one (the trainer) quantizes its K/V the same way."""
    if not runtime.plan.has_kv:
        return None
    from transformers import DynamicCache

    class FP4KVCache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            k, v = runtime.quant_kv(layer_idx, key_states, value_states)
            return super().update(k, v, layer_idx, *args, **kwargs)

    return FP4KVCache(config=model.config)


def install_fp4(model: nn.Module, plan: SitePlan, *, backend: str = "auto") -> FP4Runtime:
    """Swap the modules that own ``plan``'s sites for FP4 modules; returns their shared runtime."""
    runtime = FP4Runtime(plan, backend=backend)
    # Every MoE block is swapped, FP4 or not: its routing is recorded through the runtime either way.
    for i, name, block in moe_blocks(model):
        if isinstance(block, FP4MoEBlock):
            block.runtime = runtime
        else:
            model.model.layers[i].mlp = FP4MoEBlock(block, i, name, runtime)
    for spec in plan.sites:
        if spec.kind != "linear":
            continue
        parent_name, _, attr = spec.module.rpartition(".")
        parent = model.get_submodule(parent_name)
        lin = getattr(parent, attr)
        if isinstance(lin, nn.Linear):
            setattr(parent, attr, FP4Linear(lin, spec.module, runtime))
    model.fp4_runtime = runtime
    return runtime
