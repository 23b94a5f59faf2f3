"""TRACE at a realistic size on one GPU: fidelity per mode, the rollout's cost of capturing hints, and the
trainer's cost of hint-guided vs plain FP4 QAT.

    python benchmarks/benchmark_tracerl_h200.py                 # GPU: hidden 2048, 40 layers, 20 hinted
    python benchmarks/benchmark_tracerl_h200.py --smoke         # CPU: a tiny model, same code paths

Sections (each saved to the JSON at --out as soon as it finishes; a failing section is logged and the next
one runs):

``paths``: the decode paths on one model (``graph``: `tracerl.rollout.decode.StaticDecoder` replayed as a CUDA graph;
   ``static``: the same step run eagerly; ``hf``: the model's own forward with a `DynamicCache`): step time,
   and graph == static bit for bit (tokens, log-probs, codes, recorded hints and scales).
``sync`` (CUDA): host synchronizations counted by torch's sync debug mode over 64 decode steps with and
   without capture, for the hf path and the --decode path; the difference is what capture adds (none by design).
``capture``: decode step time of the FP4 rollout at the same batch with and without hint capture (capture =
   `tracefp4.quantize_fake` at the hinted sites instead of `fake_quantize` (one pass: output + codes/scales/hints) + routed-expert ids + ring buffers / recorder staging and
   asynchronous device-to-host drains; no host sync per step). Runs alternate, median of --reps. With
   ``--capture-margin M:MS`` (issue 23) a third engine records the same sites as margin-exception rows (a
   `MemorySink` declaring them with hint encoding margin: marks in the step, rows packed on the device when
   written), timed alternately with the others (``step_ms_capture_margin``, ``margin_overhead_pct``); its marks run
   in the capture kernel's own pass (the default, `StaticDecoder` ``fuse_marks``); ``--capture-marks-apart`` also
   times an engine with a marks launch per site in the step's stream (``step_ms_capture_margin_apart``), and
   ``--capture-marks-side-stream`` one with those launches on a side stream of the step (``marks_stream``;
   ``step_ms_capture_margin_side``).
``trainer``: forward + backward time of one packed micro-batch in ``fp4_rne_own_scales`` vs ``fp4_hints``
   (hints and scales already on the device, and from host numpy arrays as a reader hands them out).
``fidelity``: `tracerl.demo.run_demo` at this size (FP4 rollout of trajectories of >= 4K tokens recorded to a
   local tracestore store, bf16 floor run, trainer recompute in every mode, metrics).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import tracefp4  # noqa: E402
from tracerl.config import DemoConfig
from tracerl.demo import run_demo  # noqa: E402
from tracerl.rollout import RolloutEngine  # noqa: E402
from tracerl.policy import TinyMoESpec, build_model, moe_blocks  # noqa: E402
from tracerl.hints import PackedHints, Segment
from tracerl.policy import install_fp4  # noqa: E402
from tracerl.rollout import MemorySink, RolloutRecorder  # noqa: E402
from tracerl.policy import plan_sites  # noqa: E402
from tracerl.train import QATTrainer  # noqa: E402

GPU_SPEC = dict(hidden_size=2048, num_layers=40, num_heads=16, num_kv_heads=4, head_dim=128, num_experts=32,
                top_k=4, moe_intermediate_size=512, vocab_size=32768, max_position_embeddings=16384)
SMOKE_SPEC = dict(hidden_size=64, num_layers=4, num_heads=2, num_kv_heads=1, head_dim=32, num_experts=8, top_k=2,
                  moe_intermediate_size=32, vocab_size=256)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _setup(spec, device, seed, dtype=torch.bfloat16):
    """The benchmark model with FP4 installed (MoE input of the latter half hinted): model, runtime, hinted
    site widths and MoE layer names."""
    model = build_model(spec, seed=seed, device=device).to(dtype)
    plan = plan_sites(model, hint_layers="latter-half")
    rt = install_fp4(model, plan)
    widths = {s.name: s.width for s in plan.hinted_specs()}
    return model, rt, widths, [name for _, name, _ in moe_blocks(model)]


def _prompts(spec, batch, prompt, seed, ragged=False):
    """Seeded random prompts of ``prompt`` tokens (``ragged``: + 7 per row, so the batch is left-padded)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, spec.vocab_size, (prompt + (7 * b if ragged else 0),), generator=g).tolist()
            for b in range(batch)]


def bench_capture(spec, device, batch, prompt, steps, reps, seed, decode="auto", margin=None, marks_side=False,
                  marks_apart=False):
    """Median decode step time (ms) with and without hint capture, same model, batch, prompts and decode path;
    with ``margin`` (m, m_s), also with the sites recorded as margin-exception rows (and with ``marks_apart`` /
    ``marks_side``, once more with a marks launch per site in the step's stream / on a side stream of it)."""
    from tracerl.hints import compact

    model, rt, widths, layers = _setup(spec, device, seed)
    prompts = _prompts(spec, batch, prompt, seed)
    plain = RolloutEngine(model, rt, collect_routes=False, decode=decode)
    plain.calibrate(prompts)
    cap = RolloutEngine(model, rt, collect_routes=False, decode=decode)
    mcaps = {"capture_margin": RolloutEngine(model, rt, collect_routes=False, decode=decode, margin_capture=True),
             "capture_margin_side": RolloutEngine(model, rt, collect_routes=False, decode=decode,
                                                  margin_capture=True, marks_stream=True, fuse_marks=False),
             "capture_margin_apart": RolloutEngine(model, rt, collect_routes=False, decode=decode,
                                                   margin_capture=True, fuse_marks=False)}
    plain.generate(prompts, 4, seed=seed)  # warm-up: weight cache, kernels' compilation
    names = (("plain", "capture") + (("capture_margin",) if margin else ())
             + (("capture_margin_apart",) if margin and marks_apart else ())
             + (("capture_margin_side",) if margin and marks_side else ()))
    times = {n: [] for n in names}
    prepare = {n: [] for n in names}
    bytes_recorded = {}
    path = None
    coding = compact.SiteCoding("rice3", "rice3")
    for rep in range(reps):
        for name in names:
            eng = plain
            if name != "plain":
                msites = ({s: compact.store_site(s, w, coding, margin[0], margin[1]) for s, w in widths.items()}
                          if name in mcaps else None)
                sink = MemorySink(widths, margin_sites=msites)
                eng = mcaps[name] if msites else cap
                eng.recorder = RolloutRecorder(sink, widths, moe_layers=layers, top_k=spec.top_k, flush_tokens=1024,
                                               drain_every=32)
                if rep == 0 and msites:  # the margin engine's first run compiles its mark kernels
                    eng.generate(prompts, 4, seed=seed, request_ids=[f"w-{i}" for i in range(batch)])
                    eng.recorder = RolloutRecorder(sink, widths, moe_layers=layers, top_k=spec.top_k,
                                                   flush_tokens=1024, drain_every=32)
            ids = [f"r{rep}-{i}" for i in range(batch)]
            res = eng.generate(prompts, steps, seed=seed, request_ids=ids)
            times[name].append(res.decode_s / res.decode_steps * 1e3)
            prepare[name].append(res.prepare_s)
            path = res.decode_path
            if name != "plain":
                bytes_recorded[name] = eng.recorder.bytes_written
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {
        "batch": batch, "prompt_tokens": prompt, "decode_steps": steps, "reps": reps, "decode_path": path,
        "prepare_s": prepare,
        "hinted_sites": len(widths), "step_ms_plain": med["plain"], "step_ms_capture": med["capture"],
        "overhead_pct": 100 * (med["capture"] / med["plain"] - 1), "all_ms": times,
        "hint_bytes_recorded_last_rep": bytes_recorded["capture"],
        # the spread: each run's own overhead over the plain run of the same rep, min..max per engine
        "overhead_pct_range": {n: [min(pcts), max(pcts)] for n in names if n != "plain"
                               for pcts in [[100 * (a / b - 1) for a, b in zip(times[n], times["plain"])]]},
    }
    if margin:
        out.update({"margin": list(margin), "coding": coding.to_json(), "step_ms_capture_margin": med["capture_margin"],
                    "margin_overhead_pct": 100 * (med["capture_margin"] / med["plain"] - 1),
                    "margin_bytes_recorded_last_rep": bytes_recorded["capture_margin"]})
    if "capture_margin_apart" in med:
        out.update({"step_ms_capture_margin_apart": med["capture_margin_apart"],
                    "margin_apart_overhead_pct": 100 * (med["capture_margin_apart"] / med["plain"] - 1),
                    "margin_apart_bytes_recorded_last_rep": bytes_recorded["capture_margin_apart"]})
    if "capture_margin_side" in med:
        out.update({"step_ms_capture_margin_side": med["capture_margin_side"],
                    "margin_side_overhead_pct": 100 * (med["capture_margin_side"] / med["plain"] - 1),
                    "margin_side_bytes_recorded_last_rep": bytes_recorded["capture_margin_side"]})
    return out


def sync_check(spec, device, batch, prompt, steps, seed, decode="auto"):
    """Host syncs per decode step with and without capture (torch's sync debug mode counts them)."""
    import warnings

    model, rt, widths, layers = _setup(spec, device, seed)
    prompts = [list(range(1, prompt + 1))] * batch
    eng = RolloutEngine(model, rt, collect_routes=False, decode=decode)
    eng.calibrate(prompts)
    eng.generate(prompts, 2, seed=seed)
    counts = {}
    path = eng.decode_path(device)
    for name in ("plain", "capture"):
        eng.recorder = None if name == "plain" else RolloutRecorder(
            MemorySink(widths), widths, moe_layers=layers,
            top_k=spec.top_k, drain_every=32)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                eng.generate(prompts, steps, seed=seed, request_ids=[f"{name}-{i}" for i in range(batch)])
            finally:
                torch.cuda.set_sync_debug_mode(0)
        counts[name] = sum("synchroniz" in str(w.message) for w in caught)
    return {"steps": steps, "decode_path": path, "syncs": counts,
            "extra_syncs_per_step": (counts["capture"] - counts["plain"]) / steps}


def first_step_agreement(spec, device, batch, prompt, seed, dtype=torch.bfloat16):
    """One decode step from the same prefill state on each path: FP4 code agreement at the hinted sites and
    routed-expert agreement of that step, graph vs static and graph vs graph (is replay deterministic, and does it
    compute what the eager step does, up to cuBLAS's choice of kernels under capture?)."""
    model, rt, _, _ = _setup(spec, device, seed, dtype)
    prompts = _prompts(spec, batch, prompt, seed, ragged=True)
    rep = "graph" if device.type == "cuda" else "static"
    res = {}
    for i, path in enumerate((rep, rep, "static", "hf")):
        eng = RolloutEngine(model, rt, keep_codes=True, decode=path)
        if not rt.global_scales:
            eng.calibrate(prompts)
        r = eng.generate(prompts, 1, seed=seed)  # prefill + one fed step (the sampled token)
        res[("r0", "r1", "static", "hf")[i]] = r

    def last(r):
        codes = np.concatenate([np.stack([c[-1] for c in r.codes[s]]) for s in sorted(r.codes)])
        experts = np.concatenate([np.stack([e[-1] for e in r.experts[la]]) for la in sorted(r.experts)])
        return codes, experts

    a0, a1, st, hf = (last(res[k]) for k in ("r0", "r1", "static", "hf"))
    return {"dtype": str(dtype), "replayed_path": rep,
            "replay_vs_replay": {"codes": float((a0[0] == a1[0]).mean()), "experts": float((a0[1] == a1[1]).mean())},
            "replay_vs_static": {"codes": float((a0[0] == st[0]).mean()), "experts": float((a0[1] == st[1]).mean())},
            "static_vs_hf": {"codes": float((st[0] == hf[0]).mean()), "experts": float((st[1] == hf[1]).mean())}}


def compare_paths(spec, device, batch, prompt, steps, seed):
    """The three decode paths on one model: step time, and whether graph replay computes what eager does.

    ``static`` and ``graph`` run the same kernels (one eagerly, one replayed), so tokens, log-probs, codes and
    the recorded hints must be identical; ``hf`` is a different attention/cache implementation (agreement
    reported, not required)."""
    model, rt, widths, layers = _setup(spec, device, seed)
    prompts = _prompts(spec, batch, prompt, seed, ragged=True)
    out, runs = {}, {}
    # graph twice: the first pays Triton's compilation (on the CPU, where there are no graphs, static twice)
    rep = "graph" if device.type == "cuda" else "static"
    for path in (rep, "static", "hf", rep):
        eng = RolloutEngine(model, rt, keep_codes=True, decode=path)
        if not rt.global_scales:
            eng.calibrate(prompts)
        sink = MemorySink(widths)
        eng.recorder = RolloutRecorder(sink, widths, moe_layers=layers, top_k=spec.top_k, flush_tokens=1024)
        res = eng.generate(prompts, steps, seed=seed, request_ids=[f"{path}-{i}" for i in range(batch)])
        eng.recorder.close()
        runs[path] = (res, sink)
        out[path] = {"step_ms": res.decode_s / res.decode_steps * 1e3, "prepare_s": res.prepare_s,
                     "prefill_s": res.prefill_s}
    (gr, gs), (st, ss), (hf, _) = runs[rep], runs["static"], runs["hf"]

    def agree(a, b):
        return float(np.mean([(x == y).mean() for s in a.codes for x, y in zip(a.codes[s], b.codes[s])]))

    stored_equal = all(
        all(np.array_equal(gs.read(f"{rep}-{i}").hints[s], ss.read(f"static-{i}").hints[s]) and
            np.array_equal(gs.read(f"{rep}-{i}").scales[s], ss.read(f"static-{i}").scales[s]) for s in widths)
        and np.array_equal(gs.read(f"{rep}-{i}").token_ids, ss.read(f"static-{i}").token_ids)
        for i in range(batch))
    out["replayed_path"] = rep
    out["graph_vs_static"] = {
        "tokens_equal": all(np.array_equal(a, b) for a, b in zip(gr.sequences, st.sequences)),
        "max_abs_dlogp": float(max(np.abs(a - b).max() for a, b in zip(gr.logprobs, st.logprobs))),
        "code_agreement": agree(gr, st),
        "stored_hints_scales_tokens_equal": bool(stored_equal),
    }
    out["graph_vs_hf"] = {
        "tokens_equal_fraction": float(np.mean([(a == b).mean() for a, b in zip(gr.sequences, hf.sequences)])),
        "code_agreement": agree(gr, hf),
    }
    out.update(batch=batch, steps=steps, prompt_tokens=prompt)
    return out


def bench_trainer(spec, device, seqs, seq_len, reps, seed):
    """fwd+bwd time of one micro-batch (seqs x seq_len tokens) per mode; hints from a real FP4 quantization."""
    model, rt, _, _ = _setup(spec, device, seed)
    model.train()
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(1, spec.vocab_size, (seqs, seq_len), generator=g)
    packed = PackedHints(
        segments=tuple(Segment(f"t{i}", 0, seq_len) for i in range(seqs)),
        cu_seqlens=np.arange(seqs + 1) * seq_len,
        token_ids=toks.reshape(-1).numpy(),
        positions=np.tile(np.arange(seq_len), seqs),
        logprobs=np.zeros(seqs * seq_len, np.float32),
        hints={}, scales={}, experts={}, features=None,
    )
    eng = RolloutEngine(model, rt)
    eng.calibrate([t[:256].tolist() for t in toks])
    tr = QATTrainer(model, rt)
    # Hints and scales of the hinted sites from one own-scales forward (what a rollout would have recorded
    # for these activations).
    got = {}
    rt.capture = lambda site, q: got.__setitem__(site, (q.hints, q.scales))
    tr.recompute(packed, "fp4_rne_own_scales", observe=False)
    rt.capture = None
    host = {s: (h.cpu().numpy(), sc.cpu().numpy()) for s, (h, sc) in got.items()}
    variants = {
        "fp4_rne_own_scales": ("fp4_rne_own_scales", None),
        "fp4_hints_on_device": ("fp4_hints", got),
        "fp4_hints_from_host": ("fp4_hints", host),
    }
    times = {k: [] for k in variants}
    for rep in range(reps + 1):
        for name, (mode, src) in variants.items():
            if src is not None:
                packed.hints = {s: v[0] for s, v in src.items()}
                packed.scales = {s: v[1] for s, v in src.items()}
            sync(device)
            r = tr.recompute(packed, mode, backward=True, observe=False)
            if rep > 0:  # rep 0 warms up
                times[name].append(r.seconds * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    base = med["fp4_rne_own_scales"]
    # Device time (sum of the kernels' own time, torch.profiler): what the hints cost on the GPU, without the
    # host-side jitter of the trainer's Python loop (wall-clock reps spread by tens of percent).
    dev_ms = {}
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        for name, (mode, src) in variants.items():
            if src is not None:
                packed.hints = {s: v[0] for s, v in src.items()}
                packed.scales = {s: v[1] for s, v in src.items()}
            sync(device)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                tr.recompute(packed, mode, backward=True, observe=False)
                sync(device)
            dev_ms[name] = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3
    return {
        "tokens": seqs * seq_len, "sequences": seqs, "reps": reps,
        "fwd_bwd_ms": med, "all_ms": times, "min_ms": {k: min(v) for k, v in times.items()},
        "device_kernel_ms": dev_ms,
        "hints_device_overhead_pct": (100 * (dev_ms["fp4_hints_on_device"] / dev_ms["fp4_rne_own_scales"] - 1)
                                      if dev_ms else None),
        "hints_overhead_pct_on_device": 100 * (med["fp4_hints_on_device"] / base - 1),
        "hints_overhead_pct_from_host": 100 * (med["fp4_hints_from_host"] / base - 1),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU (checks the code paths)")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "tracerl-h200.json"),
                   help="JSON path (default: $OUT/tracerl-h200.json, or ./tracerl-h200.json without $OUT)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per fidelity trajectory (default 4096)")
    p.add_argument("--trajectories", type=int, default=4, help="fidelity: trajectories (default 4)")
    p.add_argument("--capture-steps", type=int, default=256, help="capture: decode steps timed per run (default 256)")
    p.add_argument("--capture-batches", default="4,16", metavar="B,...",
                   help="capture: comma-separated decode batch sizes, each timed apart (default 4,16)")
    p.add_argument("--reps", type=int, default=5, help="runs per timed figure, the median reported (default 5)")
    p.add_argument("--sections", default="paths,first_step,sync,capture,trainer,fidelity",
                   help="comma-separated subset of paths,first_step,sync,capture,trainer,fidelity (sync: CUDA only)")
    p.add_argument("--decode", default="auto", help="decode path of capture/sync/fidelity: auto|hf|static|graph")
    p.add_argument("--capture-margin", default=None, metavar="M:MS",
                   help="capture: also time recording the sites as margin-exception rows at value margin M and "
                        "scale margin MS (default: not timed)")
    p.add_argument("--capture-marks-apart", action="store_true",
                   help="capture with --capture-margin: also time the marks as a launch per site in the step's stream "
                        "instead of in the capture kernel (the default)")
    p.add_argument("--capture-marks-side-stream", action="store_true",
                   help="capture with --capture-margin: also time the marks on a side stream of the step instead of "
                        "in its own stream (the default)")
    p.add_argument("--hint-layers", default="latter-half", help="fidelity: hinted layers (latter-half, all, ...)")
    p.add_argument("--hint-sites", default="moe-input", help="fidelity: hinted sites per layer (moe-input, all-fp4)")
    p.add_argument("--replay-routes", action="store_true", help="fidelity: trainer replays the rollout's routes")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the rollouts (default 0)")
    args = p.parse_args(argv)

    if args.smoke:
        device = torch.device("cpu")
        spec = TinyMoESpec(**SMOKE_SPEC)
        tokens, trajs, cap_steps, batches, reps = 96, 2, 16, [2], 1
        train_seqs, train_len = 2, 64
    else:
        device = torch.device("cuda")
        spec = TinyMoESpec(**GPU_SPEC)
        tokens, trajs, cap_steps = args.tokens, args.trajectories, args.capture_steps
        batches, reps = [int(b) for b in args.capture_batches.split(",")], args.reps
        train_seqs, train_len = 2, 4096
    out = {
        "benchmark": "tracerl-h200",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "kernels_backend": tracefp4.resolve_backend("auto", device),
        "spec": spec.__dict__,
        "hinted": f"fidelity: hint_layers={args.hint_layers}, hint_sites={args.hint_sites}; other sections: MoE "
                  "input of the latter half of the layers",
    }

    def save():
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1, default=float)

    sections = args.sections.split(",")
    t0 = time.perf_counter()

    def say(msg):
        print(f"[{time.perf_counter() - t0:6.0f}s] {msg}", flush=True)

    def section(name, fn):
        """Run one section; a failure is logged and saved, and the next section still runs."""
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - a benchmark keeps what the other sections measure
            import traceback

            traceback.print_exc()
            out.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"
            say(f"section {name} failed: {type(e).__name__}: {e}")
        save()

    def run_paths():
        out["paths"] = compare_paths(spec, device, batches[0], 64, min(cap_steps, 128), args.seed)
        say(f"decode paths: {out['paths']}")

    def run_first_step():
        out["first_step"] = [first_step_agreement(spec, device, batches[0], 64, args.seed, dtype=dt)
                             for dt in (torch.bfloat16, torch.float32)]
        for r in out["first_step"]:
            say(f"first decode step: {r}")

    def run_sync():
        if device.type == "cuda":
            out["sync_check"] = [sync_check(spec, device, batches[0], 64, 64, args.seed, decode=d)
                                 for d in dict.fromkeys(("hf", args.decode))]
            for c in out["sync_check"]:
                say(f"sync check: {c}")

    def run_capture():
        out["capture"] = []
        for b in batches:
            margin = tuple(float(v) for v in args.capture_margin.split(":")) if args.capture_margin else None
            c = bench_capture(spec, device, b, 64, cap_steps, reps, args.seed, decode=args.decode, margin=margin,
                              marks_side=args.capture_marks_side_stream, marks_apart=args.capture_marks_apart)
            out["capture"].append(c)
            save()
            extra = (f", {c['step_ms_capture_margin']:.3f} with margin capture ({c['margin_overhead_pct']:+.2f}%)"
                     if margin else "")
            if "step_ms_capture_margin_apart" in c:
                extra += (f", {c['step_ms_capture_margin_apart']:.3f} with a marks launch per site "
                          f"({c['margin_apart_overhead_pct']:+.2f}%)")
            if "step_ms_capture_margin_side" in c:
                extra += (f", {c['step_ms_capture_margin_side']:.3f} with its marks on a side stream "
                          f"({c['margin_side_overhead_pct']:+.2f}%)")
            say(f"capture B={c['batch']} ({c['decode_path']}): {c['step_ms_plain']:.3f} ms/step plain, "
                f"{c['step_ms_capture']:.3f} with capture ({c['overhead_pct']:+.2f}%){extra}; each run's overhead "
                f"min..max {c['overhead_pct_range']}; all {c['all_ms']}")

    def run_trainer():
        out["trainer"] = bench_trainer(spec, device, train_seqs, train_len, reps, args.seed)
        t = out["trainer"]
        say(f"trainer fwd+bwd {t['tokens']} tokens: {t['fwd_bwd_ms']} (hints {t['hints_overhead_pct_on_device']:+.2f}%"
            f" on device, {t['hints_overhead_pct_from_host']:+.2f}% from host); all {t['all_ms']}")

    def run_fidelity():
        with tempfile.TemporaryDirectory() as tmp:
            cfg = DemoConfig(model="qwen3-moe", trajectories=trajs, tokens=tokens, prompt_tokens=(64, 64),
                             seed=args.seed, store=f"{tmp}/store", device=str(device), decode=args.decode,
                             hint_layers=args.hint_layers, hint_sites=args.hint_sites,
                             replay_routes=args.replay_routes,
                             micro_batch_tokens=2 * tokens, flush_tokens=1024, spec=dict(spec.__dict__))
            cfg.spec.pop("family")
            res = run_demo(cfg, progress=say)
        out["fidelity"] = res
        from rich.console import Console

        from tracerl.cli import render_table

        Console(width=160).print(render_table(res))
        r = res["rollout"]
        print(f"rollout: {r['tokens']} tokens, decode {r['decode_s']:.1f}s for {r['decode_steps']} steps "
              f"({r['decode_path']}, prepare {r['decode_prepare_s']:.1f}s); total {res['seconds']:.1f}s")

    runners = {"paths": run_paths, "first_step": run_first_step, "sync": run_sync, "capture": run_capture,
               "trainer": run_trainer, "fidelity": run_fidelity}
    unknown = [n for n in sections if n not in runners]
    if unknown:
        p.error(f"unknown sections {unknown}; choose from {', '.join(runners)}")
    for name in sections:  # in the order given
        section(name, runners[name])
    out["seconds"] = time.perf_counter() - t0
    save()
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
