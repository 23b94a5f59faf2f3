"""The model patcher: TRACE's hint-guided FP4 quantization-aware forward installed in a Hugging Face MoE model the
trainer already has, with no change to its code, and removable.

``patch = patch_model(model, store)`` reads the site plan and global scales a store records (or takes a
`tracerl.policy.SitePlan` and a ``global_scales`` dict, or a site table from ``tracerl audit --target-excess``), checks
every site against the model, and installs, all through PyTorch module hooks:

- at each activation site ``<module>.input`` (the MoE input ``model.layers.{i}.mlp.experts.input``, an attention
  projection's input with ``fp4="experts+attention"``): a forward pre-hook that replaces the module's input by its
  NVFP4 fake quantization — hint-guided with the rollout's scales at hinted sites (``mode="fp4_hints"``), round to
  nearest with its own scales elsewhere — with a straight-through backward;
- at the experts of each MoE layer whose weights are stacked (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I],
  ``act_fn``, as transformers' Qwen3-MoE): their forward runs tracerl's grouped expert GEMMs on NVFP4 fake-quantized
  weights (straight-through) with the down-projection input as an FP4 site of its own
  (``model.layers.{i}.mlp.experts.down_proj.input``, its top-k slots in ascending expert order) — the same
  arithmetic as tracerl's own trainer (`tracerl.policy.FP4MoEBlock`), so the same store gives the same codes;
- with ``routing_replay=True``, at each router (``model.layers.{i}.mlp.gate``, returning (logits, weights, indices)):
  a forward hook that replaces the chosen experts by the rollout's and weights them by the router's own
  probabilities (renormalized as the router does), so the router still gets gradients.

The rollout's tensors of the current micro-batch reach the hooks through ``with patch.micro_batch(batch):`` around
the forward and backward, ``batch`` a `tracerl.hints.FeedBatch` (or any object with ``hints``, ``scales`` and
``experts`` dicts of tensors, row for row with the forward's tokens; a store site of scale encoding ``lsb`` hands out
scale hints, from which the hooks reconstruct the rollout's scale bytes with the forward's own activations,
`tracerl.hints.scalehints`; a store site of hint encoding ``margin`` hands out margin exceptions in
``batch.margin``, from which the site reconstructs the rollout's scale bytes and hint bits with the forward's own
activation, `MarginSites`). Rows: the forward's tokens flattened must be the
batch's THD tokens in order (an input of shape [1, T] or [T]); a padded layout passes ``rows`` (each THD token's
row in the flattened [B * L] input) and ``nrows``. Outside a ``micro_batch`` block the patched sites round to nearest
with their own scales (a QAT forward without hints).

The weights are quantized inside the forward from whatever tensors the module holds then — with FSDP2, the unsharded
weights of the unit being computed, one fake quantization per expert stack per forward.

``patch.remove()`` (or leaving ``with patch:``) takes every hook and forward back: the model computes exactly what it
did before (tested bit for bit).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

import tracefp4
import tracestore as ts
from tracerl.errors import HintMismatchError, PatchError
from tracerl.hints import compact
from tracerl.hints.compact_device import unpack_sites
from tracerl.hints.scalehints import scale_encodings as _encodings_of
from tracerl.hints.scalehints import use_store_scale_encodings
from tracerl.policy import FP4Runtime, SitePlan, check_mode, effective_codes, routed_experts

__all__ = ["MarginSites", "Patch", "decode_margin", "patch_model"]

#: the modes in which a hinted site takes the rollout's scales (and, in fp4_hints, its hint bits)
_ROLLOUT_SCALE_MODES = ("fp4_rne_rollout_scales", "fp4_hints")


class MarginSites:
    """The `FP4Runtime.substitute` hook that quantizes a forward's margin sites (tracestore hint encoding
    ``margin``) from the rollout's margin exceptions: at such a site, in ``fp4_rne_rollout_scales`` / ``fp4_hints``,
    the scale bytes and hint bits are `compact.fill` of the forward's own activation and the stored exceptions
    (`compact.reconstruct`'s rule, with the runtime's global scale of the site, the one the rollout divided by; the
    exceptions are laid out as `compact.DenseExceptions` once per site, so each forward after the first makes no host
    sync there), then the site quantizes exactly as a bits site does: ``tracefp4.fake_quantize(x, scales=,
    hints=)`` (hints only in ``fp4_hints``), straight-through backward; with the runtime's ``observe`` set, it
    reports the effective codes and scales as `FP4Runtime.quant` does. Every other site, and every site in the
    other modes, goes on as it would (``chain``, else the runtime's own quantization).

    Args:
        runtime: the model's `FP4Runtime` (its mode, global scales, backend and ``observe`` are read per call).
        exceptions: site -> `compact.MarginExceptions` of the T THD rows of the micro-batch (masks bool [T, W] and
            [T, W/16], kept bits / bytes) or `compact.DenseExceptions` (the planes ``tracefp4.margin_fill`` reads),
            e.g. ``FeedBatch.margin`` or `decode_margin` of a `PackedHints`.
        rows, nrows: for a padded forward, each THD row's row (long [T]) in the forward's [nrows, W] input; rows the
            batch does not cover get scale byte 0 (they quantize to 0, as at a bits site). None: the forward's rows
            are the THD rows.
        chain: a substitute hook already set (it is asked first; its non-None answer wins).

    A call raises `HintMismatchError` when the activation's rows or width do not fit the exceptions.
    """

    def __init__(self, runtime: FP4Runtime,
                 exceptions: Mapping[str, compact.MarginExceptions | compact.DenseExceptions], *,
                 rows: torch.Tensor | None = None, nrows: int | None = None, chain: Any = None):
        self.runtime = runtime
        self.exceptions = dict(exceptions)
        self.rows, self.nrows, self.chain = rows, nrows, chain
        #: site -> its exceptions as `compact.DenseExceptions` on the forward's device, made at the site's first call
        self._dense: dict[str, compact.DenseExceptions] = {}

    def __call__(self, site: str, x: torch.Tensor) -> torch.Tensor | None:
        if self.chain is not None:
            y = self.chain(site, x)
            if y is not None:
                return y
        rt = self.runtime
        enc = self.exceptions.get(site)
        if enc is None or rt.mode not in _ROLLOUT_SCALE_MODES:
            return None
        n, w = x.shape
        rows = None if self.rows is None else self.rows.to(x.device)
        t_ = n if rows is None else int(rows.shape[0])
        if enc.shape != (t_, w) or (rows is not None and n != self.nrows):
            raise HintMismatchError(f"margin site {site}: activation [{n}, {w}] ({t_} batch rows) does not fit margin "
                                    f"exceptions of shape {list(enc.shape)}")
        g = rt.global_scale_on(site, x.device)
        x_rows = x.detach() if rows is None else x.detach().index_select(0, rows)  # [T, W]
        dense = self._dense.get(site)
        if dense is None or dense.value_marks.device != x.device:  # laid out once per site and device
            dense = self._dense[site] = compact.densify(enc).to(x.device, non_blocking=True)
        scales, hints = compact.fill(dense, x_rows, g, backend=rt.backend)  # [T, W/16], [T, W/8]
        if rows is not None:
            scales = x.new_zeros((n, w // compact.BLOCK), dtype=torch.uint8).index_copy_(0, rows, scales)
            hints = x.new_zeros((n, w // 8), dtype=torch.uint8).index_copy_(0, rows, hints)
        y = tracefp4.fake_quantize(x, fmt="nvfp4", global_scale=g, scales=scales,
                                   hints=hints if rt.mode == "fp4_hints" else None, backend=rt.backend)
        if rt.observe is not None:
            rt.observe(site, effective_codes(y.detach(), scales, g, rt.backend), scales)
        return y


def decode_margin(store: ts.Store, packed: Any, device: str | torch.device = "cpu", *, decode: str = "host"
                  ) -> dict[str, compact.MarginExceptions | compact.DenseExceptions]:
    """The margin exceptions of a `PackedHints`' margin rows (``packed.margin``: site -> (data uint8 [n], offsets
    int64 [T + 1])), decoded in each site's coding (``store.sites``), on ``device``.

    ``decode``: where (`compact_device.unpack_sites`): "host" (numpy, then copied to ``device``), "device" (the
    torch codec there: the sites that share a width, coding and scale payload in one decode over their rows stacked,
    one or two syncs per such group, on a side stream of a CUDA device, so they do not wait for the caller's queued
    work), "triton" (one Triton kernel per coding straight into `compact.DenseExceptions`, the planes `compact.fill`
    reads; one sync per call), "auto" (`compact_device.resolve_margin_decode`: "triton" on CUDA, else "host"). The
    default stays "host" for callers that have not opted in. The results are equal either way (`compact.densify` of
    the others' is the "triton" result).

    Raises `HintCodingError` for rows that do not decode, `ConfigError` for a site that is not a margin site or an
    unknown ``decode``."""
    rows_of = getattr(packed, "margin", None) or {}
    return unpack_sites({site: compact.packed_from_store(store.sites[site], rows) for site, rows in rows_of.items()},
                        device, decode)


def _plan_and_scales(source: Any, global_scales: Mapping[str, float] | None) -> tuple[SitePlan, dict[str, float]]:
    """A SitePlan and its global scales from a store, a store's model metadata, a site table or a SitePlan."""
    if isinstance(source, ts.Store):
        source = source.model
    if isinstance(source, SitePlan):
        plan, meta = source, {}
    elif isinstance(source, Mapping) and "site_plan" in source:  # store model metadata (or a planner site table)
        meta = source
        plan = SitePlan.from_json(source["site_plan"])
    elif isinstance(source, Mapping) and "model" in source and "site_plan" in (source.get("model") or {}):
        meta = source["model"]  # a site table from `tracerl audit --target-excess`
        plan = SitePlan.from_json(meta["site_plan"])
    else:
        raise PatchError(f"patch_model needs a tracestore Store, its model metadata (with 'site_plan'), a site "
                         f"table or a SitePlan; got {type(source).__name__}")
    scales = dict(global_scales if global_scales is not None else (meta.get("global_scales") or {}))
    missing = [s.name for s in plan.sites if s.name not in scales]
    if missing:
        raise PatchError(f"no global scale for FP4 sites {missing[:4]} (pass global_scales=..., or a store whose "
                         "metadata records them)")
    return plan, scales


@dataclasses.dataclass
class _Target:
    """What one site, router or expert stack needs, found and checked before anything is installed."""

    kind: str  # "input" | "experts" | "router"
    module: nn.Module
    name: str  # module path
    site: str | None = None
    layer: int | None = None
    down_site: str | None = None


def _module(model: nn.Module, path: str, site: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:
        raise PatchError(f"site {site}: the model has no module {path!r}") from None


def _width_of_input(module: nn.Module) -> int | None:
    if isinstance(module, nn.Linear):
        return module.in_features
    w = getattr(module, "gate_up_proj", None)
    return int(w.shape[-1]) if isinstance(w, torch.Tensor) and w.dim() == 3 else None


def _stacked_experts(module: nn.Module) -> bool:
    gu, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(gu, torch.Tensor) and isinstance(down, torch.Tensor) and gu.dim() == 3 and down.dim() == 3
            and callable(getattr(module, "act_fn", None)))


def _targets(model: nn.Module, plan: SitePlan, routing_replay: bool) -> list[_Target]:
    """Every hook to install, checked against ``model`` (PatchError for the first mismatch)."""
    out: list[_Target] = []
    downs = {s.layer: s for s in plan.sites if s.kind == "moe_down"}
    for spec in plan.sites:
        if spec.kind == "kv":
            raise PatchError(f"site {spec.name}: FP4 KV-cache sites are not module inputs; patch_model supports "
                             "moe_input, moe_down and linear sites")
        if spec.kind == "moe_down":
            continue  # with its layer's experts
        module = _module(model, spec.module, spec.name)
        width = _width_of_input(module)
        if width is not None and width != spec.width:
            raise PatchError(f"site {spec.name}: the plan says width {spec.width}, module {spec.module} takes "
                             f"{width} features")
        if spec.kind == "moe_input":
            if not _stacked_experts(module):
                raise PatchError(f"site {spec.name}: {spec.module} ({type(module).__name__}) has no stacked expert "
                                 "weights gate_up_proj [E, 2I, H] / down_proj [E, H, I] and act_fn; patch_model "
                                 "runs MoE experts of that form")
            down = downs.get(spec.layer)
            if down is not None:
                e, hidden, inter = module.down_proj.shape
                top_k = down.width // inter if inter else 0
                if top_k * inter != down.width or top_k < 1:
                    raise PatchError(f"site {down.name}: width {down.width} is not top_k x {inter} (the experts' "
                                     "intermediate size)")
            out.append(_Target("experts", module, spec.module, spec.name, spec.layer,
                               None if down is None else down.name))
            if routing_replay:
                router = spec.module.rsplit(".", 1)[0] + ".gate"
                out.append(_Target("router", _module(model, router, spec.name), router, None, spec.layer))
        elif spec.kind == "linear":
            if not isinstance(module, nn.Linear):
                raise PatchError(f"site {spec.name}: {spec.module} is a {type(module).__name__}, not an nn.Linear")
            out.append(_Target("input", module, spec.module, spec.name, spec.layer))
        else:
            raise PatchError(f"site {spec.name}: unknown site kind {spec.kind!r}")
    orphans = sorted(set(downs) - {t.layer for t in out if t.kind == "experts"})
    if orphans:
        raise PatchError(f"down-projection sites of layers {orphans} without their layer's MoE input site")
    return out


class Patch:
    """Hooks installed by `patch_model` (see the module docstring); `remove` takes them back."""

    def __init__(self, model: nn.Module, runtime: FP4Runtime, mode: str, targets: list[_Target]):
        self.model = model
        self.runtime = runtime
        self.mode = mode
        self._handles: list[Any] = []
        self._forwards: list[nn.Module] = []
        #: with ``observe=True``: site -> uint8 [N, W] effective E2M1 codes of the last forward in a micro_batch
        self.codes: dict[str, torch.Tensor] = {}
        for t in targets:
            getattr(self, f"_install_{t.kind}")(t)

    # ---- installing ----------------------------------------------------------------------------------
    def _install_input(self, t: _Target) -> None:
        rt, site = self.runtime, t.site
        name = t.name

        def pre(module, args, kwargs):
            x = args[0]
            y = rt.quant(site, x.reshape(-1, x.shape[-1])).reshape(x.shape)
            return (y, *args[1:]), kwargs

        def weight_in(module, args, kwargs):
            w = module._parameters.pop("weight")
            module._tracerl_weight = w
            module.weight = rt.weight(name, w)  # a plain attribute for this forward: F.linear reads it
            return None

        def weight_out(module, args, output):
            del module.weight
            module._parameters["weight"] = module.__dict__.pop("_tracerl_weight")
            return None

        self._handles += [t.module.register_forward_pre_hook(pre, with_kwargs=True),
                          t.module.register_forward_pre_hook(weight_in, with_kwargs=True),
                          t.module.register_forward_hook(weight_out)]

    def _install_experts(self, t: _Target) -> None:
        """The experts' forward: the MoE input site, slots in ascending expert order (the down site's layout and
        tracerl's own block), grouped GEMMs on fake-quantized weights, the down-projection site."""
        rt, module, name = self.runtime, t.module, t.name
        site, down_site = t.site, t.down_site

        def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
            x_q = rt.quant(site, hidden_states)
            idx, perm = top_k_index.sort(dim=-1)
            weights = top_k_weights.gather(-1, perm)
            w_gate_up = rt.weight(f"{name}.gate_up_proj", module.gate_up_proj)  # (E, 2I, H)
            w_down = rt.weight(f"{name}.down_proj", module.down_proj)  # (E, H, I)
            down = (lambda h: rt.quant(down_site, h)) if down_site is not None else None
            return routed_experts(x_q, idx, weights, w_gate_up, w_down, module.act_fn, down_quant=down)

        module.forward = forward  # an instance attribute: `remove` deletes it and the class's forward is back
        self._forwards.append(module)

    def _install_router(self, t: _Target) -> None:
        rt, layer = self.runtime, t.layer

        def post(module, args, output):
            forced = rt.forced_routes.get(layer)
            if forced is None:
                return None
            logits, weights, idx = output
            if forced.shape != idx.shape:
                raise PatchError(f"layer {layer}: replayed routes {tuple(forced.shape)} for a forward of "
                                 f"{tuple(idx.shape)} (tokens, top_k)")
            forced = forced.to(device=idx.device, dtype=idx.dtype)
            probs = torch.softmax(logits.float(), dim=-1).gather(-1, forced)
            if getattr(module, "norm_topk_prob", True):
                probs = probs / probs.sum(dim=-1, keepdim=True)
            return logits, probs.to(weights.dtype), forced

        self._handles.append(t.module.register_forward_hook(post))

    # ---- using -----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def micro_batch(self, batch: Any, *, mode: str | None = None, observe: bool = False,
                    rows: torch.Tensor | None = None, nrows: int | None = None) -> Iterator[Patch]:
        """The rollout's tensors of ``batch`` (a `FeedBatch`) in the patched forward inside the block; its margin
        sites (``batch.margin``) are quantized by `MarginSites` (reconstructed from the forward's own activation).

        ``mode``: one of `tracerl.policy.MODES` (default: the patch's). ``rows`` / ``nrows``: for a padded forward,
        each THD token's row of the flattened input and their number (rows the batch does not cover get scale 0,
        which quantizes them to 0). ``observe``: keep each site's effective codes of the forward in `codes`.

        Raises `ConfigError` for an unknown mode; the forward raises `HintMismatchError` when the rows do not fit."""
        mode = mode or self.mode
        check_mode(mode)
        dev = next(self.model.parameters()).device

        def fit(t: torch.Tensor) -> torch.Tensor:
            t = t.to(dev, non_blocking=True)
            if rows is None:
                return t
            out = torch.zeros(nrows, *t.shape[1:], dtype=t.dtype, device=dev)
            out[rows.to(dev)] = t
            return out

        hinted = set(self.runtime.plan.hinted)
        given = getattr(batch, "scale_encodings", None) or {}
        differ = {s: (e, self.runtime.scale_encodings.get(s, "bytes")) for s, e in given.items()
                  if s in hinted and e != self.runtime.scale_encodings.get(s, "bytes")}
        if differ:
            raise PatchError(f"the batch's scale encodings differ from the patch's at {differ} (batch, patch): "
                             "patch the model from the store the feed reads (patch_model(model, store))")
        provided = {s: (fit(batch.scales[s]), fit(batch.hints[s]) if mode == "fp4_hints" else None)
                    for s in hinted if s in batch.scales} if mode in ("fp4_rne_rollout_scales", "fp4_hints") else {}
        layers = {s.layer: s.module.rsplit(".", 1)[0] for s in self.runtime.plan.sites if s.kind == "moe_input"}
        forced = {la: fit(batch.experts[name]).long() for la, name in layers.items()
                  if batch.experts and name in batch.experts}
        margin = dict(getattr(batch, "margin", None) or {})
        substitute = (MarginSites(self.runtime, {s: e for s, e in margin.items() if s in hinted},
                                  rows=None if rows is None else rows.to(dev), nrows=nrows,
                                  chain=self.runtime.substitute) if margin else self.runtime.substitute)
        self.codes = {}

        def on_observe(site: str, codes: torch.Tensor, scales: torch.Tensor) -> None:
            self.codes[site] = codes if rows is None else codes.index_select(0, rows.to(codes.device))

        with self.runtime.using(mode=mode, provided=provided, forced_routes=forced,
                                observe=on_observe if observe else None, substitute=substitute):
            yield self

    def remove(self) -> None:
        """Take every hook and forward back (idempotent)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        for module in self._forwards:
            module.__dict__.pop("forward", None)
        self._forwards = []

    def __enter__(self) -> Patch:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def patch_model(model: nn.Module, source: Any, *, global_scales: Mapping[str, float] | None = None,
                mode: str = "fp4_hints", routing_replay: bool = False, backend: str = "auto",
                scale_encodings: Mapping[str, str] | None = None) -> Patch:
    """Install TRACE's hint-guided FP4 fake quantization in ``model`` (see the module docstring); returns the
    `Patch`.

    Args:
        model: a Hugging Face-style MoE causal LM (its modules named as the plan names them).
        source: a `tracestore.Store` (its model metadata's ``site_plan`` and ``global_scales``), such metadata, a
            site table (``tracerl audit --target-excess``), or a `tracerl.policy.SitePlan` with ``global_scales``.
        mode: what the sites do inside `Patch.micro_batch` (`tracerl.policy.MODES`; default ``fp4_hints``).
        routing_replay: replay the rollout's routed experts at every MoE layer's router.
        backend: the tracefp4 kernel backend (``auto``: Triton on CUDA).
        scale_encodings: {site: "bytes" | "lsb"} of the scale rows the batches carry (default: a store source's
            manifest, else bytes everywhere).

    Raises `PatchError` (nothing installed) for a site whose module the model lacks or whose width differs, a site
    kind it cannot patch (FP4 KV cache), experts without stacked weights, a missing global scale; `ConfigError`
    for an unknown mode."""
    check_mode(mode)
    plan, scales = _plan_and_scales(source, global_scales)
    targets = _targets(model, plan, routing_replay)  # everything checked before anything changes
    runtime = FP4Runtime(plan, scales, backend=backend)
    if scale_encodings is None and isinstance(source, ts.Store):
        scale_encodings = _encodings_of(source)
    if scale_encodings:
        use_store_scale_encodings(runtime, scale_encodings)
    runtime.set_mode("fp4_rne_own_scales")  # outside micro_batch: a QAT forward without hints
    return Patch(model, runtime, mode, targets)

