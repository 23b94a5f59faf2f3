"""The trainer's recompute passes of an audit: what each pass does at each FP4 site (`PassSpec`), one packed
micro-batch with the replay's and the store's values on the device (`AuditMicroBatch`), the runtime hook that
drives the sites (`substitute_hook`), and the per-mode summaries and slices of what a pass measured."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

import tracefp4
from tracerl.audit import metrics as am
from tracerl.audit import plan as ap
from tracerl.audit.replay import ReplayBatch
from tracerl.audit.setup import Setup, StoredTrajectory
from tracerl.config import margin_name
from tracerl.errors import ConfigError
from tracerl.hints import PackedHints, compact
from tracerl.hints.scalehints import pack_scale_lsb, reconstruct_scales
from tracerl.policy import SitePlan, effective_codes
from tracerl.train import QATTrainer
from tracerl.util import to_device

#: the slices of each mode's ``detail`` entry
DETAIL_KEYS = ("per_site", "per_layer", "per_trajectory", "per_policy_version", "by_position")


@dataclasses.dataclass(frozen=True)
class PassSpec:
    """One trainer recompute of every audited token: which FP4 sites do what (``actions``: site ->
    ``scales`` | ``hints`` (the store's) | ``replay_hints`` | ``exact`` (the replay's) | ``margin`` (margin
    exceptions of the replay at point ``margin``); absent: own RNE), routing replay, and whether code metrics are
    taken (``observe``). ``fp4=False``: the bf16 trainer. ``margin``: (index, (m, m_s, payload)) of the margin point
    (`ReplayBatch.marks`) the ``margin`` sites are encoded at; ``site_margins``: {site: (index, point)} for
    ``margin`` sites encoded at a point of their own (a joint planner pass mixes points), overriding ``margin``."""

    name: str
    fp4: bool = True
    actions: Mapping[str, str] = dataclasses.field(default_factory=dict)
    replay_routes: bool = False
    observe: bool = False
    margin: tuple[int, tuple[float, float, str]] | None = None
    site_margins: Mapping[str, tuple[int, tuple[float, float, str]]] = dataclasses.field(default_factory=dict)

    def margin_of(self, site: str) -> tuple[int, tuple[float, float, str]]:
        """(index, (m, m_s, payload)) of the margin point ``site`` is encoded at. Raises `ConfigError` when the
        spec names none for it (a ``margin`` action without a point)."""
        got = self.site_margins.get(site, self.margin)
        if got is None:
            raise ConfigError(f"pass {self.name!r}: site {site!r} has action 'margin' but no margin point (give "
                              "margin= or site_margins=)")
        return got


def mode_passes(plan: SitePlan) -> list[PassSpec]:
    stored = {s: "hints" for s in plan.hinted}
    return [PassSpec("bf16", fp4=False),
            PassSpec("fp4_rne_own_scales", observe=True),
            PassSpec("fp4_rne_rollout_scales", actions={s: "scales" for s in plan.hinted}, observe=True),
            PassSpec("fp4_hints", actions=stored, observe=True),
            PassSpec("fp4_hints_replay_routes", actions=stored, replay_routes=True, observe=True),
            PassSpec("fp4_rne_replay_routes", replay_routes=True, observe=True)]


def attribution_passes(plan: SitePlan, groups: Sequence[ap.SiteGroup]) -> list[PassSpec]:
    """``exact:<group>``: routes replayed and every group up to this one (in `ap.attribution_order`) exact, the
    store's hints at the other hinted sites; the last one is the residual (every FP4 site exact)."""
    stored = {s: "hints" for s in plan.hinted}
    out, exact = [], {}
    order = ap.attribution_order(groups)
    for i, g in enumerate(order):
        exact.update({s: "exact" for s in g.sites})
        # the last pass (every FP4 site exact) also counts codes: a check that exact means the rollout's codes
        out.append(PassSpec(f"exact:{g.name}", actions={**stored, **exact}, replay_routes=True,
                            observe=i == len(order) - 1))
    return out


def hint_pass(name: str, units: Sequence[ap.SiteGroup]) -> PassSpec:
    return PassSpec(name, actions={s: "replay_hints" for u in units for s in u.sites})


def margin_passes(margins: Sequence[tuple[float, float, str]], sites: Sequence[str]) -> list[PassSpec]:
    """Per margin point: ``margin:<point>`` (``sites`` as margin exceptions, the other FP4 sites RNE with own
    scales, own routes) and ``margin_replay_routes:<point>`` (the same with the rollout's routes)."""
    out = []
    for j, point in enumerate(margins):
        acts = {s: "margin" for s in sites}
        out += [PassSpec(f"margin:{margin_name(point)}", actions=acts, observe=True, margin=(j, tuple(point))),
                PassSpec(f"margin_replay_routes:{margin_name(point)}", actions=acts, replay_routes=True,
                         observe=True, margin=(j, tuple(point)))]
    return out


def margin_alone_pass(unit: ap.SiteGroup, j: int, point: tuple[float, float, str]) -> PassSpec:
    """``hint:<unit>@<point>``: the unit's sites as margin exceptions at margin point ``j`` (``point``), every
    other FP4 site RNE with own scales, own routes: the joint planner's value of that option."""
    return PassSpec(f"hint:{unit.name}@{margin_name(point)}", actions={s: "margin" for s in unit.sites},
                    margin=(j, tuple(point)))


def joint_pass(name: str, assignment: Mapping[str, str], units: Mapping[str, ap.SiteGroup],
               margins: Sequence[tuple[float, float, str]], replay_routes: bool = False) -> PassSpec:
    """A joint planner configuration as a pass: ``assignment`` {unit: option} with option ``bits`` (hints and
    scales from the replay, as `hint_pass`) or ``margin:<point name>`` (margin exceptions at that point of
    ``margins``, each site at its own point); the other FP4 sites RNE with own scales. Raises `ConfigError` for
    an unknown unit or option."""
    points = {ap.margin_option(margin_name(p)): (j, tuple(p)) for j, p in enumerate(margins)}
    actions: dict[str, str] = {}
    site_margins: dict[str, tuple[int, tuple[float, float, str]]] = {}
    for unit, option in assignment.items():
        if unit not in units or (option != ap.BITS_OPTION and option not in points):
            raise ConfigError(f"joint pass {name!r}: unit {unit!r} with option {option!r}; units are "
                              f"{sorted(units)[:4]}..., options {[ap.BITS_OPTION, *points]}")
        for s in units[unit].sites:
            if option == ap.BITS_OPTION:
                actions[s] = "replay_hints"
            else:
                actions[s] = "margin"
                site_margins[s] = points[option]
    return PassSpec(name, actions=actions, replay_routes=replay_routes, site_margins=site_margins)


#: bins per ladder step (values) and per E4M3 step (scales) of the trainer's own positions in `EntropyTally`
CODE_BINS, SCALE_BINS = 32, 16
_U_MAX = 16  # ladder positions past this share the last bin (saturated values)
_W_MAX = 128  # E4M3 positions are in [1, 126]


class EntropyTally:
    """The floor any hint encoding can reach at a site (issue 23): the entropy of the rollout's scale bytes and
    codes given what the trainer computes itself, estimated from joint counts over the response tokens of the
    round-to-nearest pass. Scales: ``H(S_r | w_t)``, the trainer's own E4M3 position ``w_t`` of each block
    (`compact.scale_position` of its amax) in bins of 1/16 step. Codes, once the scales are known: ``H(C_r | sign,
    u_t)``, the trainer's ladder position under the rollout's scale in bins of 1/32 step (Slepian-Wolf: the rate
    the rollout needs when the trainer holds its own values). The bin edges fall on the rounding boundaries, so a
    trainer whose values are the rollout's gets 0 bits (ties aside). Binning only coarsens what the trainer knows
    (an upper bound of the true conditional entropy) but the plug-in estimate is biased low when bins hold few
    values: `site_floor` gives the values per occupied bin to judge it by (millions per site on the H200 model,
    a few on the CPU demo)."""

    def __init__(self, sites: Sequence[str]):
        self.sites = set(sites)
        self.codes: dict[str, torch.Tensor] = {}  # site -> int64 [2 * U bins * 16]
        self.scales: dict[str, torch.Tensor] = {}  # site -> int64 [W bins * 256]
        self.tokens: dict[str, int] = {}

    def add(self, site: str, x: torch.Tensor, g: torch.Tensor, codes_r_packed: torch.Tensor,
            scales_r: torch.Tensor) -> None:
        """Response rows: the trainer's activation [R, W], its global scale, the rollout's packed codes uint8
        [R, W/2] and scale bytes uint8 [R, W/16]."""
        xf = x.float()
        w = compact.scale_position(compact.block_scale_t(xf, g))
        wb = (w * SCALE_BINS).floor().clamp(0, _W_MAX * SCALE_BINS - 1).long()
        js = (wb * 256 + scales_r.long()).flatten()
        u = compact.ladder_position(compact.scaled_values(xf, scales_r, g))
        ub = (u.abs() * CODE_BINS).floor().nan_to_num(0).clamp(0, _U_MAX * CODE_BINS - 1).long()
        ub = ub + torch.signbit(u).long() * (_U_MAX * CODE_BINS)
        jc = (ub * 16 + tracefp4.unpack_codes(codes_r_packed).long()).flatten()
        nc, ns = 2 * _U_MAX * CODE_BINS * 16, _W_MAX * SCALE_BINS * 256
        c, sc = torch.bincount(jc, minlength=nc), torch.bincount(js, minlength=ns)
        self.codes[site] = self.codes[site] + c if site in self.codes else c
        self.scales[site] = self.scales[site] + sc if site in self.scales else sc
        self.tokens[site] = self.tokens.get(site, 0) + len(x)

    @staticmethod
    def _bits(joint: torch.Tensor, k: int) -> float:
        """Total conditional entropy in bits, sum over bins of n_b H(Y | b), of counts [bins * k]."""
        n = joint.double().reshape(-1, k)
        rows = n.sum(1, keepdim=True)
        p = torch.where(n > 0, n / rows.clamp(min=1), torch.ones_like(n))
        return float(-(n * torch.log2(p)).sum())

    def site_floor(self) -> dict[str, dict[str, float]]:
        """Per site: code_bits_per_token, scale_bits_per_token, bytes_per_token (their sum / 8), tokens,
        values_per_code_bin (values per occupied bin of the trainer's ladder position)."""
        out = {}
        for site, c in self.codes.items():
            t = self.tokens[site]
            cb, sb = self._bits(c, 16) / t, self._bits(self.scales[site], 256) / t
            values = int(c.sum())
            out[site] = {"code_bits_per_token": cb, "scale_bits_per_token": sb, "bytes_per_token": (cb + sb) / 8,
                         "tokens": t, "values_per_code_bin": values / max(1, int((c.reshape(-1, 16).sum(1) > 0).sum()))}
        return out


class MarginTally:
    """What one margin pass would store and how its codes agree with the rollout's, per site, over the response
    tokens: the counts ``[values, marked values, code mismatches among marked, among unmarked, blocks, marked
    blocks]`` (`metrics.codes_match`) over every response row, and the value and block marks (packed, on the
    host) of every ``every``-th response row, from which `site_bytes` prices the coding (numpy:
    `compact.choose_coding` over a few thousand rows of width 2,048 takes seconds; over an audit of 32k tokens,
    minutes). Fed with `add_marks` alone it only prices (`prices`): the joint planner's price of a site that no
    margin pass encodes."""

    def __init__(self, point: tuple[float, float, str], every: int = 1):
        self.point = point
        self.every = max(1, int(every))
        self.marks: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
        self.counts: dict[str, torch.Tensor] = {}
        self._seen: dict[str, int] = {}

    def add_marks(self, site: str, vm: torch.Tensor, bm: torch.Tensor) -> None:
        """Response rows of one micro-batch: value marks uint8 [R, W/8], block marks uint8 [R, ceil(W/128)]; keeps
        every ``every``-th row (counted across calls) on the host."""
        seen = self._seen.get(site, 0)
        self._seen[site] = seen + len(vm)
        keep = torch.arange((-seen) % self.every, len(vm), self.every, device=vm.device)  # every-th row overall
        self.marks.setdefault(site, []).append((vm.index_select(0, keep).cpu().numpy(),
                                                bm.index_select(0, keep).cpu().numpy()))

    def add(self, site: str, vm: torch.Tensor, bm: torch.Tensor, codes_t: torch.Tensor, codes_r_packed: torch.Tensor
            ) -> None:
        """Response rows of one micro-batch: value marks uint8 [R, W/8], block marks uint8 [R, ceil(W/128)],
        the trainer's codes uint8 [R, W] (unpacked) and the rollout's packed uint8 [R, W/2]."""
        self.add_marks(site, vm, bm)
        mask = tracefp4.unpack_hints(vm).bool()
        differ = ~am.codes_match(codes_t, tracefp4.unpack_codes(codes_r_packed))
        nb = codes_t.shape[1] // 16
        blocks = tracefp4.unpack_hints(bm)[:, :nb]
        c = torch.stack([torch.tensor(mask.numel(), device=mask.device), mask.sum(), (differ & mask).sum(),
                         (differ & ~mask).sum(), torch.tensor(blocks.numel(), device=mask.device),
                         blocks.sum().to(torch.int64)])
        self.counts[site] = self.counts[site] + c if site in self.counts else c

    def prices(self, width_of: Mapping[str, int]) -> dict[str, dict[str, Any]]:
        """Per site: ``width``, the bytes a store spends per token (``bytes_per_token``; None without rows): what
        `compact.pack_rows` writes for its priced rows in the cheapest coding (`choose_coding`; ``row_bytes_per_token``)
        plus the row's end (`compact.ROW_END_BYTES`), the ``coding`` ({values, blocks}), ``priced_tokens`` (every
        ``every``-th response token) and ``tokens`` (every response token)."""
        m, ms, payload = self.point
        out = {}
        for site, parts in self.marks.items():
            vm = torch.from_numpy(np.concatenate([p[0] for p in parts]))
            bm = torch.from_numpy(np.concatenate([p[1] for p in parts]))
            w = width_of[site]
            enc = compact.exceptions_from_marks(vm, bm, torch.zeros(len(vm), w // 8, dtype=torch.uint8),
                                                torch.zeros(len(vm), w // 16, dtype=torch.uint8), m, ms, payload)
            coding, _ = compact.choose_coding(enc)
            total = int(compact.packed_row_bytes(enc, coding).sum())
            row = total / len(vm) if len(vm) else None
            out[site] = {"width": w, "bytes_per_token": None if row is None else row + compact.ROW_END_BYTES,
                         "row_bytes_per_token": row,
                         "coding": coding.to_json(), "priced_tokens": len(vm), "tokens": self._seen[site]}
        return out

    def site_bytes(self, width_of: Mapping[str, int]) -> dict[str, dict[str, Any]]:
        """Per site: `prices`, and the mark and mismatch counts (every response token): values, marked_values,
        blocks, marked_blocks, marked_mismatch, unmarked_mismatch."""
        out = self.prices(width_of)
        for site, row in out.items():
            values, marked, mm, um, blocks, marked_blocks = (int(v) for v in self.counts[site].cpu())
            row.update({"values": values, "marked_values": marked, "blocks": blocks, "marked_blocks": marked_blocks,
                        "marked_mismatch": mm, "unmarked_mismatch": um})
        return out


class AuditMicroBatch:
    """A packed micro-batch on the device: forward rows of the trainer's layout, the replay's codes/scales and
    the store's hints/scales gathered to THD rows (each once, on first use), and its response tokens."""

    def __init__(self, s: Setup, rep: ReplayBatch, packed: PackedHints):
        self.s, self.rep, self.packed = s, rep, packed
        dev = s.device
        inputs, self.rows = s.trainer._layout(packed, dev)
        self.nrows = int(inputs["input_ids"].numel())
        local = {t.traj_id: b for b, t in enumerate(rep.trajs)}
        self.b_host = np.concatenate([np.full(len(g), local[g.traj_id]) for g in packed.segments]).astype(np.int64)
        self.pos_host = np.asarray(packed.positions, dtype=np.int64)
        self.b_dev = to_device(torch.as_tensor(self.b_host), dev)
        self.pos_dev = to_device(torch.as_tensor(self.pos_host), dev)
        self.response = ~np.isnan(np.asarray(packed.logprobs))
        self.resp_dev = to_device(torch.as_tensor(np.flatnonzero(self.response)), dev)
        self._cache: dict[tuple[str, str], torch.Tensor] = {}

    def _get(self, key: tuple[str, str], make: Callable[[], torch.Tensor]) -> torch.Tensor:
        t = self._cache.get(key)
        if t is None:
            t = self._cache[key] = make()
        return t

    def replay_codes(self, site: str) -> torch.Tensor:  # packed uint8 [T, W/2]
        return self._get((site, "rc"), lambda: self.rep.codes[site][self.b_dev, self.pos_dev])

    def replay_scales(self, site: str) -> torch.Tensor:  # uint8 [T, W/16]
        return self._get((site, "rs"), lambda: self.rep.scales[site][self.b_dev, self.pos_dev])

    def replay_marks(self, site: str, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Margin point ``j``'s marks at ``site``: value marks uint8 [T, W/8], block marks uint8 [T, ceil(W/128)]."""
        vm, bm = self.rep.marks[site]
        return (self._get((site, f"vm{j}"), lambda: vm[j][self.b_dev, self.pos_dev]),
                self._get((site, f"bm{j}"), lambda: bm[j][self.b_dev, self.pos_dev]))

    def stored(self, site: str, what: str) -> torch.Tensor:  # what: "hints" [T, W/8] | "scales" [T, W/16]
        return self._get((site, what), lambda: to_device(torch.as_tensor(
            np.ascontiguousarray(getattr(self.packed, what)[site])), self.s.device))

    def scale_hints(self, site: str) -> bool:
        """Whether the store keeps scale hints at ``site`` (scale encoding lsb, FORMAT §2.4), not scale bytes."""
        return site in self.packed.scales and self.s.train.scale_encodings.get(site) == "lsb"

    def reference_scales(self, site: str) -> torch.Tensor:
        """The rollout's scales: as stored at the store's hinted sites (stored as bytes), as replayed elsewhere
        (and at sites with scale hints, whose bytes the store does not hold; the replay reproduces them: checked
        by `reproduction` through their LSBs)."""
        if site in self.packed.scales and not self.scale_hints(site):
            return self.stored(site, "scales")
        return self.replay_scales(site)

    def forward_rows(self, key: tuple[str, str], thd: Callable[[], torch.Tensor]) -> torch.Tensor:
        """THD rows [T, C] -> the trainer's forward rows [nrows, C] (rows it does not cover: 0, scale 0 -> 0)."""
        return self._get((key[0], "fwd-" + key[1]),
                         lambda: QATTrainer._scatter(thd(), self.rows, self.nrows, self.s.device))

    def reproduction(self) -> np.ndarray:
        """[equal hint bytes, hint bytes, equal scale bytes, scale bytes] of the replay against the store at
        the store's hinted sites, over every row of the micro-batch."""
        out = np.zeros(4, np.int64)
        for site in self.packed.hints:
            h = tracefp4.hints_from_codes(self.replay_codes(site)) == self.stored(site, "hints")
            rs = self.replay_scales(site)
            sc = (pack_scale_lsb(rs) if self.scale_hints(site) else rs) == self.stored(site, "scales")
            out += np.array([int(h.sum()), h.numel(), int(sc.sum()), sc.numel()])
        return out


def substitute_hook(mb: AuditMicroBatch, spec: PassSpec, tally: am.CodeTally | None,
                    margin_tally: MarginTally | None = None, entropy: EntropyTally | None = None):
    """The `FP4Runtime.substitute` hook of one pass over one micro-batch (the pass's site actions; with a
    ``tally``, code metrics at every observable site). The runtime's mode is ``fp4_rne_own_scales``, so a site
    the hook leaves alone (None) is rounded to nearest with its own scales, as it would be here too."""
    rt = mb.s.train
    observable = set(mb.s.observable)

    def sub(site: str, x: torch.Tensor) -> torch.Tensor | None:
        act = spec.actions.get(site)
        if site not in observable or (act is None and tally is None):
            return None
        g = rt.global_scale_on(site, x.device)
        if act == "margin":  # the rollout's margin exceptions at the pass's point, the trainer's reconstruction
            j, (m, ms, payload) = spec.margin_of(site)
            vm = mb.forward_rows((site, f"vm{j}"), lambda: mb.replay_marks(site, j)[0])
            bm = mb.forward_rows((site, f"bm{j}"), lambda: mb.replay_marks(site, j)[1])
            rh = mb.forward_rows((site, "rh"), lambda: tracefp4.hints_from_codes(mb.replay_codes(site)))
            rs = mb.forward_rows((site, "rs"), lambda: mb.replay_scales(site))
            enc = compact.exceptions_from_marks(vm, bm, rh, rs, m, ms, payload)
            rec = compact.reconstruct(enc, x.detach(), g, backend=rt.backend)
            y = tracefp4.fake_quantize(x, fmt="nvfp4", global_scale=g, scales=rec.scales_e4m3, hints=rec.hints_packed,
                                       backend=rt.backend)
            if tally is not None or margin_tally is not None:
                used = rec.scales_e4m3.index_select(0, mb.rows)
                codes = effective_codes(y.detach().index_select(0, mb.rows), used, g)
                if tally is not None:
                    tally.add(site, codes, mb.replay_codes(site), used, mb.reference_scales(site))
                if margin_tally is not None:
                    resp = mb.resp_dev
                    vt, bt = mb.replay_marks(site, j)
                    margin_tally.add(site, vt.index_select(0, resp), bt.index_select(0, resp),
                                     codes.index_select(0, resp), mb.replay_codes(site).index_select(0, resp))
            return y
        if act == "exact":  # the rollout's quantized values, as its forward used them
            scales = mb.forward_rows((site, "rs"), lambda: mb.replay_scales(site))
            y = tracefp4.dequantize(mb.forward_rows((site, "rc"), lambda: mb.replay_codes(site)), scales,
                                    fmt="nvfp4", global_scale=g, dtype=x.dtype, backend=rt.backend)
            if tally is not None:  # a self-check: the codes y carries are the rollout's
                used = scales.index_select(0, mb.rows)
                tally.add(site, effective_codes(y.index_select(0, mb.rows), used, g), mb.replay_codes(site), used,
                          mb.replay_scales(site))
            return y
        if act is not None:
            if act == "replay_hints":
                scales = mb.forward_rows((site, "rs"), lambda: mb.replay_scales(site))
                hints = mb.forward_rows((site, "rh"), lambda: tracefp4.hints_from_codes(mb.replay_codes(site)))
            else:
                scales = mb.forward_rows((site, "scales"), lambda: mb.stored(site, "scales"))
                if mb.scale_hints(site):  # the bytes the trainer works out from its own x (today's rule after)
                    scales = reconstruct_scales(x.detach(), g, scales)
                hints = (mb.forward_rows((site, "hints"), lambda: mb.stored(site, "hints")) if act == "hints"
                         else None)
            y = tracefp4.fake_quantize(x, fmt="nvfp4", global_scale=g, scales=scales, hints=hints,
                                       backend=rt.backend)
            if tally is not None:
                used = scales.index_select(0, mb.rows)
                tally.add(site, effective_codes(y.detach().index_select(0, mb.rows), used, g), mb.replay_codes(site),
                          used, mb.reference_scales(site))
            return y
        y, q = tracefp4.quantize_fake(x, "nvfp4", global_scale=g, backend=rt.backend)
        tally.add(site, tracefp4.unpack_codes(q.codes.index_select(0, mb.rows)), mb.replay_codes(site),
                  q.scales.index_select(0, mb.rows), mb.reference_scales(site))
        if entropy is not None and site in entropy.sites:
            resp = mb.resp_dev
            entropy.add(site, x.detach().index_select(0, mb.rows.index_select(0, resp)), g,
                        mb.replay_codes(site).index_select(0, resp), mb.replay_scales(site).index_select(0, resp))
        return y

    return sub


@dataclasses.dataclass
class PassState:
    """What one pass accumulates over the micro-batches."""

    spec: PassSpec
    log: am.TokenLog
    tally: am.CodeTally | None
    layer_flips: dict[int, int]
    layer_tokens: int = 0
    seconds: float = 0.0
    floor_log: am.TokenLog | None = None  # the bf16 pass: also against the floor decode
    margin: MarginTally | None = None  # a margin pass (own routes): what it stores, how its codes agree
    entropy: EntropyTally | None = None  # the RNE pass with margin points: the floor of any hint encoding


def run_pass(s: Setup, mb: AuditMicroBatch, st: PassState) -> None:
    """Recompute ``mb`` in ``st.spec`` and append its response tokens' rows to ``st``."""
    spec = st.spec
    t0 = time.perf_counter()
    if st.tally is not None:
        st.tally.begin(mb.resp_dev)
    if spec.fp4:
        with s.train.using(substitute=substitute_hook(mb, spec, st.tally, st.margin, st.entropy)):
            r = s.trainer.recompute(mb.packed, "fp4_rne_own_scales", observe=False, replay_routes=spec.replay_routes)
    else:
        r = s.trainer.recompute(mb.packed, "bf16", observe=False, replay_routes=spec.replay_routes)
    codes = st.tally.end() if st.tally is not None else None
    st.seconds += time.perf_counter() - t0
    resp = mb.response
    b, pos = mb.b_host[resp], mb.pos_host[resp]
    trajs = mb.rep.trajs
    prompt = np.array([t.prompt_len for t in trajs])[b]
    index = np.array([t.index for t in trajs])[b]
    version = np.array([t.version for t in trajs])[b]
    routes = {la: ids[resp] for la, ids in r.routes.items()}
    stored_routes = {name: ids[resp] for name, ids in mb.packed.experts.items()}
    flips, per_layer = am.route_flips(routes, stored_routes, s.moe_names)
    for la, n in per_layer.items():
        st.layer_flips[la] = st.layer_flips.get(la, 0) + n
    st.layer_tokens += int(resp.sum())
    lp = r.logprobs[resp].astype(np.float64)
    st.log.add(traj=index, position=pos - prompt, version=version, dlogp=lp - np.asarray(mb.packed.logprobs)[resp],
               flips=flips, layers=len(routes), codes=codes)
    if st.floor_log is not None:
        floor_lp = mb.rep.floor_logprobs[b, pos - prompt].astype(np.float64)
        ff, _ = am.route_flips(routes, {la: mb.rep.floor_experts[la][b, pos] for la in routes})
        st.floor_log.add(traj=index, position=pos - prompt, version=version, dlogp=lp - floor_lp, flips=ff,
                         layers=len(routes))


def mode_summary(log: am.TokenLog, tally: am.CodeTally | None, hinted: set[str]) -> dict[str, Any]:
    d = log.column("dlogp")
    stats = am.dlogp_summary(d)
    layers = log.column("layers").sum()
    out = {"code_agreement": None, "scale_agreement": None, "one_step_share": None, "multi_step_share": None,
           "router_flip_rate": float(log.column("flips").sum() / layers) if layers else None,
           **{k: stats[k] for k in ("mean_abs_dlogp", "p99_abs_dlogp", "max_abs_dlogp", "k3", "extreme_frac",
                                     "tokens")}}
    if tally is not None and hinted:
        counts = tally.site_counts()
        a = am.agreement(np.stack([counts[h] for h in hinted if h in counts]) if counts else np.zeros(5))
        out.update({k: a[k] for k in ("code_agreement", "scale_agreement", "one_step_share", "multi_step_share")})
    return out


def site_rows(s: Setup, tally: am.CodeTally) -> tuple[list[dict], dict[int, dict]]:
    counts = tally.site_counts()
    hinted = set(s.plan.hinted)
    sites, layers = [], {}
    for spec in s.plan.sites:
        if spec.name not in counts:
            continue
        c = counts[spec.name]
        sites.append({"site": spec.name, "layer": spec.layer, "kind": spec.kind, "hinted": spec.name in hinted,
                      "width": spec.width, **am.agreement(c)})
        la = layers.setdefault(spec.layer, {"all": np.zeros(5, np.int64), "hinted": np.zeros(5, np.int64)})
        la["all"] += c
        if spec.name in hinted:
            la["hinted"] += c
    return sites, layers


def detail_of(s: Setup, st: PassState, floor_abs: np.ndarray, trajs: list[StoredTrajectory], bucket: int) -> dict[str, Any]:
    out = {k: [] for k in DETAIL_KEYS}
    layer_counts: dict[int, dict] = {}
    if st.tally is not None:
        out["per_site"], layer_counts = site_rows(s, st.tally)
    for la in sorted(s.moe_names):
        c = layer_counts.get(la)
        hinted = am.agreement(c["hinted"]) if c is not None else None
        every = am.agreement(c["all"]) if c is not None else None
        out["per_layer"].append({
            "layer": la,
            "hinted_code_agreement": hinted["code_agreement"] if hinted else None,
            "code_agreement": every["code_agreement"] if every else None,
            "one_step_share": every["one_step_share"] if every else None,
            "scale_agreement": every["scale_agreement"] if every else None,
            "router_flip_rate": st.layer_flips.get(la, 0) / st.layer_tokens if st.layer_tokens else None,
        })
    out.update(am.breakdown(st.log, floor_abs, [t.traj_id for t in trajs], bucket, st.tally is not None))
    return out
