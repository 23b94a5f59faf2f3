"""The hooks the plugin installs in SGLang 0.5.23 (`tracerl.sglang.targets.HOOKS`), and the process state they share.

Each hook is a thin adapter: it reads SGLang's objects (by attribute, as the 0.5.23 sources define them) and calls
`SlotCapture` (in the forward) or `RecordingSession` (at a request's finish). In the forward, the hook bodies only
enqueue device work, so they run when SGLang runs the forward eagerly or records it into a CUDA graph, and the
graph's replays repeat that device work without any Python; what runs every step is `around_forward` (host code
outside the graph, no sync). Only TP rank 0 of each server (and DP replica) records: in the supported settings
every TP rank sees the same MoE input rows.

Errors at start (settings, store, targets) raise ``SystemExit`` with one message: SGLang swallows ordinary
exceptions of plugins and of ``apply_hooks``.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import tracestore as ts
from tracerl.sglang import checks, targets
from tracerl.sglang.capture import SlotCapture, chain_outputs
from tracerl.sglang.config import SGLangConfig
from tracerl.sglang.errors import PluginConfigError, SGLangPluginError, TargetMismatchError, UnsupportedSettingError
from tracerl.sglang.session import FinishedRequest, RecordingSession

log = logging.getLogger(__name__)

__all__ = ["State", "STATE", "install", "hook_table", "stop", "finished_request"]


def stop(message: str) -> SystemExit:
    """The ``SystemExit`` that stops SGLang at start with ``message`` (logged too: SGLang's own log shows it)."""
    log.error("tracerl.sglang: %s", message)
    return SystemExit(f"tracerl.sglang: {message}")


class State:
    """What the hooks of one process share: the configuration, the recording session and capture (on the
    recording rank, once the model runner started), the MoE layer whose ``apply`` is running, and the finished
    requests of the batch being processed."""

    def __init__(self, cfg: SGLangConfig | None = None):
        self.cfg = cfg
        self.session: RecordingSession | None = None
        self.capture: SlotCapture | None = None
        self.recording = False
        self.started = False
        self.local = threading.local()  # .layer: the FusedMoE layer in apply
        self.pending: list[tuple[Any, Any, np.ndarray | None]] = []
        # SGLang's routed-experts capturer and a request's weight-version spans (SGLang's own functions; a test
        # that drives the hooks without SGLang's runtime puts stand-ins of SGLang's parts here)
        self.routes: Callable[[], Any] = _sglang_routes
        self.spans: Callable[[Any], list[tuple[str, int, int]]] = _sglang_spans



# ---- start ------------------------------------------------------------------------------------------------
def before_model_runner_init(self, model_config, mem_fraction_static, gpu_id, nccl_port, server_args,
                             is_draft_worker=False, *args, **kwargs):
    """``ModelRunner.__init__`` (BEFORE): verify the patches, refuse unsupported settings, open the store."""
    st = STATE
    if st.cfg is None or is_draft_worker or st.started:
        return None
    st.started = True
    problems = targets.check_applied(hook_table())
    if problems:
        raise stop("SGLang did not apply every hook (" + "; ".join(problems) + "); nothing would be recorded")
    try:
        start_session(st, server_args, os.environ)
    except (SGLangPluginError, ts.TraceStoreError) as e:
        raise stop(str(e)) from None
    return None


def start_session(st: State, server_args: Any, env: Any, *, rank: tuple[int, int] | None = None) -> None:
    """Open the store and the session of this process (only TP rank 0 records).

    Raises UnsupportedSettingError, PluginConfigError, tracestore errors."""
    cfg = st.cfg
    store = ts.open_store(cfg.store, storage_options=cfg.storage_options or None)
    found = checks.refusals(server_args, env, needs_routes=bool(store.moe_layers))
    if found:
        raise UnsupportedSettingError("cannot record exactly under these settings: " + "; ".join(found))
    if rank is None:
        from sglang.srt.runtime_context import get_parallel

        par = get_parallel()
        rank = (int(getattr(par, "dp_rank", 0) or 0), int(par.tp_rank))
    dp_rank, tp_rank = rank
    if tp_rank != 0:
        log.info("tracerl.sglang: TP rank %d does not record (rank 0 of its group does)", tp_rank)
        store.close()
        return
    backend = str(getattr(server_args, "moe_runner_backend", "auto") or "auto")
    settings = checks.quantizer_settings(
        server_args, env, backend=backend,
        device_capability=torch.cuda.get_device_capability() if torch.cuda.is_available() else None,
        flashinfer_version=_version("flashinfer-python"))
    writer_id = cfg.writer_id(dp_rank=dp_rank, tp_rank=tp_rank, port=getattr(server_args, "port", None))
    st.session = RecordingSession(cfg, store, writer_id, quantizer=settings, sglang_version=targets.sglang_version())
    st.recording = True
    atexit.register(st.session.close)
    log.info("tracerl.sglang: recording %d sites into %s as writer %s", len(st.session.layer_sites), store.url,
             writer_id)


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def after_init_routed_experts_capturer(result, self):
    """``ModelRunner.init_routed_experts_capturer`` (AFTER): the KV pool exists, CUDA graphs are not captured
    yet: check the hinted layers and allocate the capture (sized as SGLang sizes its routed-experts capture)."""
    st = STATE
    if not st.recording or getattr(self, "is_draft_worker", False) or st.capture is not None:
        return None
    try:
        st.capture = allocate_capture(st.session, self)
    except (SGLangPluginError, ts.TraceStoreError) as e:
        raise stop(str(e)) from None
    return None


def allocate_capture(session: RecordingSession, runner: Any) -> SlotCapture:
    """The `SlotCapture` for ``runner`` (SGLang's ``ModelRunner``): every hinted layer must be an NVFP4 MoE layer
    on the TRT-LLM backend with the store's width; routed experts must be captured when the store declares MoE
    layers. Raises UnsupportedSettingError, PluginConfigError."""
    layers = {}
    for mod in runner.model.modules():
        qm = getattr(mod, "quant_method", None)
        if qm is not None and hasattr(mod, "layer_id") and hasattr(mod, "dispatcher"):
            layers[int(mod.layer_id)] = mod
    for layer_id, site in session.layer_sites.items():
        mod = layers.get(layer_id)
        if mod is None:
            raise PluginConfigError(f"site {site}: the model has no MoE layer {layer_id}")
        name = type(mod.quant_method).__name__
        if name != "ModelOptNvFp4FusedMoEMethod":
            raise UnsupportedSettingError(f"site {site}: MoE layer {layer_id} runs {name}, not NVFP4 "
                                          "(ModelOptNvFp4FusedMoEMethod); record an NVFP4 (ModelOpt FP4) checkpoint")
        backend = str(getattr(getattr(mod.quant_method, "_moe_runner_backend", None), "value", "unknown"))
        if backend not in checks.SUPPORTED_BACKENDS:
            raise UnsupportedSettingError(f"MoE layer {layer_id} resolved the MoE runner backend {backend}; "
                                          "start SGLang with --moe-runner-backend flashinfer_trtllm (Blackwell)")
        session.quantizer_settings["moe_runner_backend"] = backend
    widths = set(session.widths.values())
    hidden = int(runner.model_config.hidden_size)
    if widths != {hidden}:
        raise PluginConfigError(f"store sites have widths {sorted(widths)}; the model's hidden size is {hidden}")
    routes = STATE.routes()
    if session.moe_layers and routes is None:
        raise UnsupportedSettingError("the store declares MoE layers and SGLang captures no routed experts: start "
                                      "it with --enable-return-routed-experts")
    max_rows = routes.device_cache.buffer.shape[0] if routes is not None else _max_rows(runner)
    num_slots = runner.kv_index_translator.capture_token_capacity(runner.max_token_pool_size)
    cap = SlotCapture(session.layer_sites, hidden, max_rows=max_rows, num_slots=num_slots, device=runner.device)
    log.info("tracerl.sglang: capture of %d layers: %d rows on %s, %.2f GB host cache for %d KV slots",
             len(session.layer_sites), max_rows, runner.device, cap.host_bytes / 2**30, num_slots)
    return cap


def _max_rows(runner: Any) -> int:
    """The most tokens one forward holds (as SGLang sizes its routed-experts device cache)."""
    from sglang.srt.runtime_context import get_parallel, get_schedule

    dp = int(getattr(get_parallel(), "num_dp_ranks", 1) or 1)
    return max(int(get_schedule().chunked_prefill_size) * dp, int(runner.max_running_requests) * dp)


# ---- every forward ------------------------------------------------------------------------------------------
def around_forward(original, self, forward_batch, *args, **kwargs):
    """``ModelRunner.forward`` (AROUND): advance the forward tag, run the forward (eager or graph replay), then hand
    its rows and KV slots to SGLang's result copy next to its routed experts (no host sync)."""
    cap = STATE.capture
    if cap is None or getattr(self, "is_draft_worker", False):
        return original(self, forward_batch, *args, **kwargs)
    cap.begin_forward()
    out = original(self, forward_batch, *args, **kwargs)
    loc = getattr(forward_batch, "out_cache_loc_virtual", None)
    if loc is None:
        loc = forward_batch.out_cache_loc
    out.routed_experts_output = chain_outputs(out.routed_experts_output, cap.take(loc))
    return out


def around_apply(original, self, *args, **kwargs):
    """``ModelOptNvFp4FusedMoEMethod.apply`` (AROUND): which layer the quantizer call inside belongs to; FP4 that a
    dispatcher delivered (``dispatch_output.hidden_states_scale``) is captured here."""
    st = STATE
    if st.capture is None:
        return original(self, *args, **kwargs)
    layer = kwargs["layer"] if "layer" in kwargs else args[0]
    dispatch_output = kwargs["dispatch_output"] if "dispatch_output" in kwargs else args[1]
    scale = getattr(dispatch_output, "hidden_states_scale", None)
    if scale is not None:
        st.capture.capture_dispatched(layer.layer_id, dispatch_output.hidden_states, scale,
                                      layer.w13_input_scale_quant)
    prev, st.local.layer = getattr(st.local, "layer", None), (None if scale is not None else layer)
    try:
        return original(self, *args, **kwargs)
    finally:
        st.local.layer = prev


def after_quantize_hidden_states_fp4(result, hidden_states, input_scale_quant):
    """``flashinfer_trtllm.quantize_hidden_states_fp4`` (AFTER): SGLang's codes uint8 [T, Hp/2] and scales
    float8_e4m3fn [T, Hp/16] of the running MoE layer, captured (a call outside an NVFP4 MoE ``apply`` is left
    alone)."""
    st = STATE
    layer = getattr(st.local, "layer", None)
    if st.capture is not None and layer is not None:
        codes, scales = result
        st.capture.capture(layer.layer_id, codes, scales, input_scale_quant)
    return None


# ---- a request's finish -------------------------------------------------------------------------------------
def after_collect_routed_experts(result, self, req):
    """``SchedulerBatchResultProcessor._maybe_collect_routed_experts`` (AFTER; called for every finished request
    before its KV slots are released): gather its captured rows and SGLang's routed experts by KV slot."""
    st = STATE
    if st.session is None or st.capture is None:
        return None
    seqlen = len(req.origin_input_ids) + len(req.output_ids_through_stop)
    # one device -> host read of the request's slots at its finish, as SGLang's own get_topk does
    slots = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx][: max(seqlen - 1, 0)].cpu().numpy()
    experts = None
    if st.session.moe_layers:
        experts = np.asarray(st.routes().get_topk(
            req_pool_idx=req.kv.req_pool_idx, seqlen=seqlen, req_to_token_pool=self.req_to_token_pool))
    st.pending.append((req, st.capture.rows(slots), experts))
    return None


def finished_request(req: Any, rows, experts, *, spans) -> FinishedRequest:
    """SGLang's finished ``Req`` as a `FinishedRequest` (``spans``: its weight-version spans)."""
    logprob = getattr(req, "logprob", None)
    reason = req.finished_reason.to_json().get("type", "") if req.finished_reason is not None else ""
    sp = getattr(req, "sampling_params", None)
    return FinishedRequest(rid=str(req.rid), prompt_ids=list(req.origin_input_ids),
                           output_ids=list(req.output_ids_through_stop),
                           output_logprobs=getattr(logprob, "output_token_logprobs_val", None), finish_reason=reason,
                           version_spans=spans, rows=rows, experts=experts,
                           custom_params=getattr(sp, "custom_params", None))


def _sglang_routes() -> Any:
    """SGLang's routed-experts capturer (None without ``--enable-return-routed-experts``)."""
    from sglang.srt.state_capturer.routed_experts import get_global_experts_capturer

    return get_global_experts_capturer()


def _sglang_spans(req: Any) -> list[tuple[str, int, int]]:
    """``req``'s weight-version spans over its output tokens, as SGLang reports them (``weight_versions``)."""
    from sglang.srt.runtime_context import get_serving
    from sglang.srt.utils.weight_versions import compute_weight_version_spans

    spans = compute_weight_version_spans(req.weight_version_events, current_version=get_serving().weight_version,
                                         num_output_tokens=len(req.output_ids))
    return [(str(s.version), int(s.start), int(s.end)) for s in spans]


def around_process_batch_result(original, self, batch, result):
    """``process_batch_result_{prefill,decode}`` (AROUND): after SGLang processed the batch (tokens and log-probs
    of its finished requests final), write those requests."""
    out = original(self, batch, result)
    st = STATE
    pending, st.pending = st.pending, []
    for req, rows, experts in pending:
        if st.session is not None:
            st.session.finish(finished_request(req, rows, experts, spans=st.spans(req)))
    return out


def before_handle_generate_request(self, recv_req, *args, **kwargs):
    """``Scheduler.handle_generate_request`` (BEFORE): with ``logprobs=force``, every request computes its output
    tokens' log-probs (the client's response has them only if it asked: SGLang's tokenizer manager adds them
    for requests that did)."""
    cfg = STATE.cfg
    if cfg is not None and cfg.logprobs == "force" and STATE.recording and not recv_req.return_logprob:
        recv_req.return_logprob = True
        recv_req.logprob_start_len = -1
    return None


STATE = State()  # this process's (the hooks are module functions: SGLang registers them once)


# ---- installation -------------------------------------------------------------------------------------------
_FUNCS = {
    "ModelRunner.__init__": before_model_runner_init,
    "ModelRunner.init_routed_experts_capturer": after_init_routed_experts_capturer,
    "ModelRunner.forward": around_forward,
    "ModelOptNvFp4FusedMoEMethod.apply": around_apply,
    "quantize_hidden_states_fp4": after_quantize_hidden_states_fp4,
    "SchedulerBatchResultProcessor._maybe_collect_routed_experts": after_collect_routed_experts,
    "SchedulerBatchResultProcessor.process_batch_result_prefill": around_process_batch_result,
    "SchedulerBatchResultProcessor.process_batch_result_decode": around_process_batch_result,
    "Scheduler.handle_generate_request": before_handle_generate_request,
}


def hook_table() -> dict[str, Any]:
    """{target path: hook function} of every hook in `targets.HOOKS`."""
    return {t.path: _FUNCS[t.qualname] for t in targets.HOOKS}


def install(cfg: SGLangConfig) -> None:
    """Register every hook with SGLang's ``HookRegistry`` (``load_plugins`` applies them after the plugin ran)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if set(_FUNCS) != {t.qualname for t in targets.HOOKS}:
        raise TargetMismatchError("hooks and targets out of step")  # an internal invariant of this module
    STATE.cfg = cfg
    kinds = {"before": HookType.BEFORE, "after": HookType.AFTER, "around": HookType.AROUND}
    for t in targets.HOOKS:
        HookRegistry.register(t.path, _FUNCS[t.qualname], kinds[t.hook])
