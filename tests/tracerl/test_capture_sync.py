"""Hint capture adds no host synchronization (issue 4), checked on the CPU.

The GPU ground truth is ``benchmarks/benchmark_tracerl_h200.py --sections sync`` (torch's CUDA sync debug
mode over 64 decode steps, plain vs capture). These tests check the same property without a GPU:

1. `test_generate_capture_adds_no_host_reads` runs the reference engine as the sync check does (plain:
   no recorder, ``collect_routes=False``; capture: a `RolloutRecorder` with drains every 4 steps) under
   `HostTraffic`, a `TorchFunctionMode` that records every torch call made by Python code that brings
   tensor values to the host (``.item()``, ``bool(t)``/``if t``, ``int(t)``, ``float(t)``, ``operator.index``,
   ``.tolist()``, ``.cpu()``, ``.numpy()``/``np.asarray(t)``, ``nonzero``/``argwhere``/``torch.where(c)``,
   ``unique``, ``masked_select``, boolean-mask indexing, ``bincount``/``histc``, ``torch.equal``/``allclose``,
   ``repeat_interleave`` with tensor repeats and no ``output_size``, ``one_hot`` without ``num_classes``,
   ``torch.tensor`` built from tensors), keyed by the op and the calling line (first frame outside torch).
   The multiset with capture must equal the one without, apart from `RolloutRecorder._materialize`, which
   only ever reads host buffers (on CUDA the pinned buffers of the asynchronous drains, read after their
   event fired). No call may come from the capture code itself (recorder, engine callbacks, `tracefp4`).
   `test_detector_sees_a_sync_in_the_capture_path` shows that a single ``.tolist()`` added to the capture
   callback fails that comparison.
2. `test_capture_step_reads_no_device_value_on_meta` runs one decode step's capture path (an `FP4MoEBlock`
   forward: router, `FP4Runtime.quant` at the hinted MoE input with the capture callback, i.e.
   `tracefp4.quantize` + dequantize, the gather decode path, the down-proj site; the engine's capture and
   route callbacks; ``record_sites/record_experts/record_tokens`` and ``step()``) on meta tensors, which have
   shapes but no data: any read of a value raises, including reads inside ATen (e.g. ``repeat_interleave``
   or ``bincount`` that compute an output size). `HostTraffic(meta=True)` also flags host-to-device copies
   (``torch.tensor(..., device=d)``, ``.to(d)``/``copy_`` from a host tensor): on CUDA a blocking one is a
   host sync too.

What they cannot detect (checked by reading the code instead): CUDA stream/event/device synchronization
(``torch.cuda.synchronize``, ``Stream.synchronize``, ``Event.synchronize``: none on the per-step path; the
engine's two ``torch.cuda.synchronize`` calls time prefill and decode and are in the plain path too), whether
a device-to-host copy targets pinned memory with ``non_blocking=True`` (on the CPU everything is host
memory; `RolloutRecorder._drain` allocates ``pin_memory=True`` buffers), syncs inside the Triton launcher or
kernels (test 2 runs the reference backend: Triton cannot run on meta; the Triton wrappers only allocate
and launch), syncs inside C++ code that Python does not see on the CPU (covered on meta for the block
forward only), and the model's own code outside the capture path (HF attention masks, sampling), which is
the same with and without capture.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

import tracefp4
from helpers.capture import HostTraffic
from tracefp4 import reference
from tracerl.rollout import RolloutEngine
from tracerl.policy import TinyMoESpec, build_model
from tracerl.policy import install_fp4
from tracerl.rollout import MemorySink, RolloutRecorder
from tracerl.policy import plan_sites

TINY = dict(hidden_size=64, num_layers=4, num_heads=2, num_kv_heads=1, head_dim=32, num_experts=4, top_k=2,
            moe_intermediate_size=32, vocab_size=128)
PROMPTS = [[5, 9, 17, 33, 2, 7], [3, 4, 5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17]]

# Code that runs per decode step only when capturing: none of it may read a device value.
CAPTURE_CODE = [("tracerl/rollout/recorder.py", None), ("tracerl/rollout/engine.py", "_on_capture"), ("tracerl/rollout/engine.py", "_on_route"),
                ("tracerl/rollout/engine.py", "_deliver_site"), ("tracerl/rollout/engine.py", "_deliver_route"),
                ("tracerl/rollout/engine.py", "_take_ring"), ("tracerl/rollout/decode.py", "_ring_write"),
                ("tracerl/rollout/decode.py", "_on_capture"), ("tracerl/rollout/decode.py", "_on_route"), ("tracerl/rollout/decode.py", "take"),
                ("tracerl/policy/runtime.py", "quant"), ("tracerl/policy/runtime.py", "global_scale_on"), ("kernels/", None)]


def _in_capture_code(key) -> bool:
    _, path, func, _ = key
    return any(path.startswith(p) and (f is None or func == f) for p, f in CAPTURE_CODE) and func != "_materialize"


def _setup(seed=0):
    spec = TinyMoESpec(**TINY)
    model = build_model(spec, seed=seed)
    plan = plan_sites(model, hint_layers="latter-half")
    rt = install_fp4(model, plan)
    widths = {s.name: s.width for s in plan.hinted_specs()}
    layers = [f"model.layers.{i}.mlp" for i in range(spec.num_layers)]
    return spec, model, rt, widths, layers


def _host_reads(sabotage: bool = False, steps: int = 9, decode: str = "hf", margin: bool = False
                ) -> dict[str, Counter]:
    """HostTraffic of one plain and one capturing `generate`, as the benchmark's sync_check runs them; with
    ``margin``, the sites are recorded as margin-exception rows (margin capture)."""
    from tracerl.hints import compact

    spec, model, rt, widths, layers = _setup()
    msites = ({s: compact.store_site(s, w, compact.SiteCoding("rice2", "gamma"), 0.1, 0.1) for s, w in widths.items()}
              if margin else None)
    eng = RolloutEngine(model, rt, collect_routes=False, decode=decode, ring=4, margin_capture=margin)
    eng.calibrate(PROMPTS)
    eng.generate(PROMPTS, 2, seed=0)  # warm-up, as in the sync check
    if margin:  # the margin's fp32 intervals: found once per margin by bisection on host tensors, then cached
        from tracefp4.margin import value_intervals

        value_intervals(0.1)
    if sabotage:
        orig = eng._on_capture

        def syncing_capture(site, q):
            q.scales.tolist()  # what a careless capture would do: read the scales on the host
            orig(site, q)

        eng._on_capture = syncing_capture
    out = {}
    for name in ("plain", "capture"):
        eng.recorder = None if name == "plain" else RolloutRecorder(
            MemorySink(widths, margin_sites=msites), widths, moe_layers=layers, top_k=spec.top_k, flush_tokens=8,
            drain_every=4)
        with HostTraffic() as ht:
            res = eng.generate(PROMPTS, steps, seed=0, request_ids=[f"{name}-{i}" for i in range(len(PROMPTS))])
        out[name] = ht.calls
        if name == "capture":
            # the capture really happened: every request was written with its hints and routes
            sink = eng.recorder.sink
            assert sorted(sink.trajectories()) == sorted(res.request_ids)
            for rid, seq in zip(res.request_ids, res.sequences):
                assert sink.num_tokens(rid) == len(seq)
    return out


def _diff(a: Counter, b: Counter) -> str:
    keys = sorted(set(a) | set(b), key=str)
    return "\n".join(f"{k}: capture {a[k]} vs plain {b[k]}" for k in keys if a[k] != b[k])


@pytest.mark.parametrize("decode, margin", [("hf", False), ("static", False), ("hf", True), ("static", True)])
def test_generate_capture_adds_no_host_reads(decode, margin):
    """Also with margin capture: the marks are computed on the device (in the step on the static path) and the
    rows packed when written, from the drained host buffers (`_margin_rows`, like `_materialize`)."""
    reads = _host_reads(decode=decode, margin=margin)
    plain = reads["plain"]
    written = ("_materialize", "_margin_rows") if margin else ("_materialize",)
    # the rows' packer (tracerl.hints.compact, called by `_margin_rows` when a request's rows are written, on the
    # drained host buffers) is not per-step code: nothing of the step calls it
    cap = Counter({k: v for k, v in reads["capture"].items()
                   if k[2] not in written and not (margin and k[1].startswith("tracerl/hints/compact"))})
    # The detector sees the engine's one result transfer (tokens, log-probs, routes, codes: `tracerl.util.to_host`)
    # in both runs.
    assert any(k[0] == "cpu" and k[1] == "tracerl/util.py" and k[2] == "to_host" for k in plain), plain
    bad = [k for k in cap if _in_capture_code(k)]
    assert not bad, f"host reads in the capture code: {bad}"
    assert cap == plain, "capture changes the host reads:\n" + _diff(cap, plain)


def test_detector_sees_a_sync_in_the_capture_path():
    reads = _host_reads(sabotage=True, steps=3)
    cap = Counter({k: v for k, v in reads["capture"].items() if k[2] != "_materialize"})
    extra = cap - reads["plain"]
    assert extra and all(k[0] == "tolist" and k[2] == "syncing_capture" for k in extra), extra


def test_capture_step_reads_no_device_value_on_meta():
    spec, model, rt, widths, layers = _setup()
    eng = RolloutEngine(model, rt, collect_routes=False)
    eng.calibrate(PROMPTS)  # static global scales on the host, as in the rollout
    hinted_layer = spec.num_layers - 1
    block = model.model.layers[hinted_layer].mlp
    assert block.input_site in widths
    block.to("meta")
    rec = RolloutRecorder(MemorySink(widths), widths, moe_layers=layers, top_k=spec.top_k, drain_every=1000)
    eng.recorder = rec
    bsz = 4
    rids = [f"m{i}" for i in range(bsz)]
    for r in rids:
        rec.begin(r)
    rt.set_mode("fp4_rne_own_scales")
    rt.capture, rt.on_route = eng._on_capture, eng._on_route
    captured = []
    orig_capture = rt.capture
    rt.capture = lambda site, q: (captured.append((site, q)), orig_capture(site, q))

    def decode_step(t):
        positions = np.full(bsz, 20 + t)
        eng._rows = (rids, positions, None)
        h = torch.empty(bsz, 1, spec.hidden_size, dtype=torch.bfloat16, device="meta")
        out = block(h)
        tok = torch.empty(bsz, dtype=torch.long, device="meta")
        lp = torch.empty(bsz, dtype=torch.float32, device="meta")
        rec.record_tokens(rids, positions, tok, lp)
        rec.step()
        return out

    try:
        decode_step(0)  # first call: the runtime copies the site's global scale to the device (once)
        with HostTraffic(meta=True) as ht:
            for t in range(1, 6):
                out = decode_step(t)
    finally:
        rt.capture = rt.on_route = None
    assert out.shape == (bsz, 1, spec.hidden_size) and out.device.type == "meta"
    assert [s for s, _ in captured] == [block.input_site] * 6
    site, q = captured[-1]
    assert q.hints.device.type == "meta" and q.hints.shape == (bsz, spec.hidden_size // 8)
    assert len(rec._staged) == 6 * 3  # sites, experts, tokens per step, all still on the device
    assert not ht.calls, ht.calls


def test_e2m1_value_equals_the_table():
    mag = torch.arange(8, dtype=torch.int32)
    want = torch.tensor(tracefp4.E2M1_MAGNITUDES, dtype=torch.float32)
    got = reference.e2m1_value(mag)
    assert got.dtype == torch.float32
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    m = torch.randint(0, 8, (5, 16), dtype=torch.uint8)
    assert torch.equal(reference.e2m1_value(m), want[m.long()])


@pytest.mark.parametrize("g", [0.0123, torch.tensor(0.0123)])
def test_quantize_global_scale_is_not_read_on_meta(g):
    """`tracefp4.quantize`'s global scale handling (float or host tensor) does not read a device value."""
    x = torch.empty(4, 64, dtype=torch.bfloat16, device="meta")
    g = g.to("meta") if isinstance(g, torch.Tensor) else g  # a device-resident g, as FP4Runtime passes it
    with HostTraffic(meta=True) as ht:
        q = tracefp4.quantize(x, global_scale=g)
    assert q.global_scale.device.type == "meta" and q.codes.shape == (4, 32)
    assert not ht.calls, ht.calls
