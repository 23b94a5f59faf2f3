"""A recording session in one SGLang scheduler process: finished requests in, store records and results out.

SGLang-agnostic: the hooks (`tracerl.sglang.hooks`) turn SGLang's ``Req`` into a `FinishedRequest` (host data:
token ids, log-probs, the weight-version spans, the captured rows of its KV slots, SGLang's routed experts) and
call `RecordingSession.finish`, which

- drops an aborted request (nothing of it was ever written: nothing becomes visible);
- builds the trajectory: positions ``[0, P + G)`` (prompt then output tokens), prompt log-probs NaN, hint and
  scale rows and routed experts from the capture for positions ``[0, P + G - 1)``; the last token was never fed
  through the model, so its row is the "never forwarded" marker (scale bytes 0, which no NVFP4 block has, hint
  bits 0) and its experts the placeholder ``0..top_k-1``;
- writes one record per weight-version span (tokens of one policy version; the prompt goes with the first), then
  the result (reward from the store's task, or none: the RL framework writes it), and makes sure a quantizer
  record (`tracerl.sglang.quantizer`) says, for that policy version and this writer, which multipliers and
  settings made the codes.

Nothing of a request is written before it finished, so an aborted, retracted-and-never-finished or crashed
request leaves nothing visible; the writer skips what a previous run of the same server already committed
(``skip_committed``), so a restart that re-runs requests does not duplicate them.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

import tracestore as ts
from tracerl.sglang import quantizer as qz
from tracerl.sglang.capture import CapturedRows
from tracerl.sglang.config import SGLangConfig, moe_input_layer
from tracerl.sglang.errors import PluginConfigError, QuantizerRecordError, SGLangPluginError
from tracestore.errors import ResultExistsError

log = logging.getLogger(__name__)

__all__ = ["FinishedRequest", "RecordingSession", "MOE_LAYER", "group_of"]

#: tracerl's MoE layer names (`tracerl.policy.moe_layer_name`)
MOE_LAYER = re.compile(r"model\.layers\.(\d+)\.mlp")
_SAMPLE_SUFFIX = re.compile(r"(.+)-s\d+")


@dataclasses.dataclass
class FinishedRequest:
    """What a finished SGLang request leaves for the store (host data).

    ``rows`` and ``experts`` (SGLang's ``get_topk``: int [P + G - 1, num_layers, top_k], indexed by layer id)
    cover positions ``[0, P + G - 1)``; ``version_spans`` are SGLang's ``weight_versions`` spans over the output
    tokens: (version string, start, end)."""

    rid: str
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    output_logprobs: Sequence[float] | None
    finish_reason: str
    version_spans: Sequence[tuple[str, int, int]]
    rows: CapturedRows
    experts: np.ndarray | None
    custom_params: Mapping[str, Any] | None = None


def group_of(rid: str, custom_params: Mapping[str, Any] | None) -> str:
    """The GRPO group of a request: ``custom_params["tracerl_group_id"]``, else the rid without a trailing
    ``-s<digits>`` (the ids `tracerl.rollout.RolloutWorker` gives), else ``""``."""
    if custom_params and isinstance(custom_params.get("tracerl_group_id"), str):
        return custom_params["tracerl_group_id"]
    m = _SAMPLE_SUFFIX.fullmatch(rid)
    return m.group(1) if m else ""


class RecordingSession:
    """One writer (``writer_id``: this server and rank) on the configured store.

    Parameters
    ----------
    cfg: the plugin's configuration. store: the open store.
    writer_id: ``<server_id>-dp<D>-tp<T>``.
    quantizer: the settings that made the codes (recorded per policy version).
    sglang_version: for the records.

    Raises `PluginConfigError` (at start) for a store whose sites are not MoE-input NVFP4 sites, sites other than
    the configured ones, or a results mode the store cannot serve.
    """

    def __init__(self, cfg: SGLangConfig, store: ts.Store, writer_id: str, *, quantizer: Mapping[str, Any],
                 sglang_version: str | None = None):
        self.cfg, self.store, self.writer_id = cfg, store, ts.check_id(writer_id, "writer id")
        self.quantizer_settings = dict(quantizer)
        self.sglang_version = sglang_version
        sites = list(store.sites)
        for s in store.sites.values():
            if s.fp4_format != "nvfp4" or s.block_size != 16:
                raise PluginConfigError(f"store {store.url}: site {s.name!r} is {s.fp4_format} with block "
                                        f"{s.block_size}; SGLang's MoE input is NVFP4 with block 16")
        if cfg.sites is not None and sorted(cfg.sites) != sorted(sites):
            raise PluginConfigError(f"configured sites {sorted(cfg.sites)[:4]}... differ from the store's "
                                    f"{sorted(sites)[:4]}... (a record carries every site the store declares)")
        self.layer_sites = {moe_input_layer(s): s for s in sites}
        self.widths = {s.name: s.width for s in store.sites.values()}
        #: sites whose store keeps scale hints (scale encoding lsb, FORMAT §2.4): their captured E4M3 bytes are
        #: packed to LSBs when a request is written
        self.lsb_sites = {s.name for s in store.sites.values() if s.scale_encoding == "lsb"}
        self.moe_layers = {}
        for name in store.moe_layers:
            m = MOE_LAYER.fullmatch(name)
            if m is None:
                raise PluginConfigError(f"store MoE layer {name!r} is not a decoder layer's MoE block "
                                        "(model.layers.<i>.mlp)")
            self.moe_layers[name] = int(m.group(1))
        self.top_k = store.top_k
        meta = store.model or {}
        self.preferred_g = {k: float(v) for k, v in (meta.get("global_scales") or {}).items()}
        results = cfg.results
        if results == "auto":
            results = "task" if "task" in meta else "none"
        if results == "task" and "task" not in meta:
            raise PluginConfigError(f"results=task, but store {store.url} declares no task in its model metadata")
        self.task = None
        if results == "task":
            from tracerl.policy import make_task

            self.task = make_task(**meta["task"])
        self.writer = store.writer(writer_id, commit_bytes=cfg.commit_bytes, commit_interval_s=cfg.commit_interval_s,
                                   skip_committed=True)
        self._recorded: dict[int, dict[str, str]] = {}  # version -> {site: multiplier bits} recorded by us
        self.stats = {"committed": 0, "aborted": 0, "dropped": 0, "tokens": 0}

    # ---- the policy version ---------------------------------------------------------------------------
    def policy_version(self, version: str) -> int:
        """SGLang's weight version string as a policy version: decimal digits as they are, ``default`` (SGLang's
        initial version) as ``cfg.default_version``. Raises `SGLangPluginError` for anything else."""
        if version == "default":
            return self.cfg.default_version
        if isinstance(version, str) and version.isdigit() and version.isascii():
            return int(version)
        raise SGLangPluginError(f"weight version {version!r} is not a policy version: publish weights with "
                                "weight_version set to the decimal policy version (e.g. \"7\")")

    # ---- a finished request ---------------------------------------------------------------------------
    def finish(self, fr: FinishedRequest) -> bool:
        """Record ``fr``; True if its records were written. An aborted request, or one that cannot be recorded
        exactly (rows its forward did not capture, a weight version that is not a number, an id the store refuses,
        a quantizer record that disagrees), is dropped with one error line naming the reason: never half-written."""
        if fr.finish_reason == "abort":
            self.stats["aborted"] += 1
            return False
        try:
            pieces, result = self._build(fr)
            for start, arrays, version in pieces:
                self.writer.write(fr.rid, start, policy_version=version, **arrays)
            if result is not None:
                try:
                    self.writer.write_result(fr.rid, **result)
                except ResultExistsError:
                    log.info("tracerl.sglang: %s already has a result (a restarted server re-ran it)", fr.rid)
        except (SGLangPluginError, ts.TraceStoreError) as e:
            self.stats["dropped"] += 1
            log.error("tracerl.sglang: request %s not recorded: %s", fr.rid, e)
            return False
        self.stats["committed"] += 1
        self.stats["tokens"] += len(fr.prompt_ids) + len(fr.output_ids)
        return True

    def _build(self, fr: FinishedRequest) -> tuple[list[tuple[int, dict, int]], dict | None]:
        ts.check_id(fr.rid, "trajectory id (the SGLang request id)")
        p, g = len(fr.prompt_ids), len(fr.output_ids)
        n = p + g
        fed = n - 1
        if g < 1:
            raise SGLangPluginError("no output token")
        if len(fr.rows.valid) != fed:
            raise SGLangPluginError(f"{len(fr.rows.valid)} captured rows for {fed} forwarded tokens")
        if not fr.rows.valid.all():
            bad = np.flatnonzero(~fr.rows.valid)
            raise SGLangPluginError(f"positions {bad[:8].tolist()} were not captured by their forward")
        token_ids = np.asarray([*fr.prompt_ids, *fr.output_ids], dtype=np.int64)
        logprobs = np.full(n, np.nan, dtype=np.float32)
        if fr.output_logprobs is not None and len(fr.output_logprobs) >= g:
            logprobs[p:] = np.asarray(fr.output_logprobs[:g], dtype=np.float32)
        else:
            log.warning("tracerl.sglang: request %s has no output log-probs (TRACERL_SGLANG_LOGPROBS=request and the "
                        "client did not ask): recorded as NaN", fr.rid)
        hints, scales = {}, {}
        for site in self.layer_sites.values():
            w = self.widths[site]
            hints[site] = np.concatenate([fr.rows.hints[site], np.zeros((1, w // 8), np.uint8)])
            scales[site] = np.concatenate([fr.rows.scales[site], np.zeros((1, w // 16), np.uint8)])
            if site in self.lsb_sites:
                # bit b of a row = LSB of block b's byte, LSB first, zero-padded: `tracerl.hints.pack_scale_lsb`
                # on the host (tested equal), without importing torch here
                scales[site] = np.packbits(scales[site] & 1, axis=1, bitorder="little")
        experts = self._experts(fr, fed)
        spans = self._spans(fr, p, g)
        pieces = []
        for start, stop, version in spans:
            self._ensure_quantizer_record(version, fr.rows, max(start, 0), min(stop, fed))
            sl = slice(start, stop)
            pieces.append((start, {"hints": {s: h[sl] for s, h in hints.items()},
                                   "scales": {s: v[sl] for s, v in scales.items()},
                                   "token_ids": token_ids[sl], "logprobs": logprobs[sl],
                                   "experts": {k: e[sl] for k, e in experts.items()} or None}, version))
        result = None
        if self.task is not None:
            reward = self.task.rewards([list(fr.prompt_ids)], [list(fr.output_ids)])[0].reward
            extra: dict[str, Any] = {"source": "sglang", "writer_id": self.writer_id}
            size = (fr.custom_params or {}).get("tracerl_group_size")
            if isinstance(size, int) and not isinstance(size, bool):
                extra["group_size"] = size
            result = {"reward": float(reward), "group_id": group_of(fr.rid, fr.custom_params), "prompt_len": p,
                      "response_len": g, "policy_version": spans[-1][2], "finish_reason": fr.finish_reason or "stop",
                      "extra": extra}
        return pieces, result

    def _experts(self, fr: FinishedRequest, fed: int) -> dict[str, np.ndarray]:
        if not self.moe_layers:
            return {}
        if fr.experts is None:
            raise SGLangPluginError("no routed experts (start the server with --enable-return-routed-experts)")
        topk = np.asarray(fr.experts)
        if topk.ndim != 3 or topk.shape[0] != fed or topk.shape[2] != self.top_k:
            raise SGLangPluginError(f"routed experts of shape {topk.shape}; expected [{fed}, layers, {self.top_k}]")
        last = np.arange(self.top_k, dtype=np.int64)[None]  # placeholder of the never-forwarded last token
        out = {}
        for name, layer in self.moe_layers.items():
            if layer >= topk.shape[1]:
                raise SGLangPluginError(f"MoE layer {name} beyond SGLang's {topk.shape[1]} captured layers")
            out[name] = np.concatenate([topk[:, layer, :].astype(np.int64), last])
        return out

    def _spans(self, fr: FinishedRequest, p: int, g: int) -> list[tuple[int, int, int]]:
        """(start, stop, policy version) over positions: SGLang's spans over the output tokens moved by the prompt
        length, the prompt joined to the first; neighbours of one policy version merged."""
        out: list[list[int]] = []
        spans = list(fr.version_spans) or [("default", 0, g)]
        for version, start, end in spans:
            v = self.policy_version(version)
            lo = 0 if not out else p + int(start)
            hi = p + min(int(end), g)
            if hi <= lo:
                continue
            if out and out[-1][2] == v:
                out[-1][1] = hi
            else:
                out.append([lo, hi, v])
        if not out or out[-1][1] != p + g:
            raise SGLangPluginError(f"weight-version spans {spans} do not cover the {g} output tokens")
        return [tuple(x) for x in out]

    def _ensure_quantizer_record(self, version: int, rows: CapturedRows, lo: int, hi: int) -> None:
        """The multipliers of rows [lo, hi) are one per site; a quantizer record of (version, this writer) says so."""
        bits = {}
        for layer, site in self.layer_sites.items():
            m = np.unique(rows.multiplier[site][lo:hi].view(np.uint32))
            if m.size > 1:
                raise QuantizerRecordError(f"site {site}: {m.size} scale multipliers within policy version {version}")
            if m.size:
                bits[site] = f"0x{int(m[0]):08x}"
        known = self._recorded.get(version)
        if known is not None:
            changed = {s: (known.get(s), b) for s, b in bits.items() if known.get(s) != b}
            if changed:
                raise QuantizerRecordError(f"policy version {version} was quantized by two rules: multipliers {changed}")
            return
        sites = {site: {"layer": layer, "multiplier": qz.f32_from_bits(bits[site]),
                        "checkpoint_global_scale": self.preferred_g.get(site)}
                 for layer, site in self.layer_sites.items() if site in bits}
        qz.put_record(self.store.area(qz.AREA), qz.make_record(version, self.writer_id, sites,
                                                               self.quantizer_settings,
                                                               sglang_version=self.sglang_version))
        self._recorded[version] = bits

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        """Commit what is buffered and close the writer."""
        self.writer.close()
        log.info("tracerl.sglang: writer %s closed: %s", self.writer_id, self.stats)
