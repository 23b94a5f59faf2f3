"""The trainer's routed-expert path: two grouped GEMMs (``torch._grouped_mm``) against the per-expert Python loop.

`tracerl.policy.experts.routed_experts` runs the expert GEMMs of an MoE layer either as two grouped GEMMs (the
default where `grouped_gemm_supported`: CPU, and bf16 on Hopper) or as a loop over the experts
(``TRACERL_GROUPED_MM=0``). This measures, for both:

1. one MoE layer, forward + backward (the H200 model's layer: 8192 tokens, hidden 2048, 32 experts top-4,
   intermediate 512): median time over ``--reps`` calls (after a warm-up), and whether the grouped path is
   bitwise reproducible over 3 runs (output and every gradient), and how far it is from the loop (on the CPU the
   two are the same bits; on a GPU CUTLASS and cuBLAS round differently);
2. the whole model (the H200 fidelity model, 40 layers): `QATTrainer.recompute` forward + backward of one
   micro-batch (2 x 4096 tokens) in ``fp4_rne_own_scales``, median over ``--reps``.

    python benchmarks/benchmark_expert_gemm.py            # GPU (H200)
    python benchmarks/benchmark_expert_gemm.py --smoke    # tiny shapes on the CPU (checks the code path)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_REPO))
sys.path.insert(0, str(_REPO / "benchmarks"))

PATHS = {"grouped": "1", "loop": "0"}  # TRACERL_GROUPED_MM


@contextlib.contextmanager
def _expert_path(name: str):
    """Run the block with the routed experts' ``name`` path (``TRACERL_GROUPED_MM``); the variable comes back."""
    prev = os.environ.get("TRACERL_GROUPED_MM")
    os.environ["TRACERL_GROUPED_MM"] = PATHS[name]
    try:
        yield
    finally:
        if prev is None:
            os.environ.pop("TRACERL_GROUPED_MM", None)
        else:
            os.environ["TRACERL_GROUPED_MM"] = prev


def _timed(fn, reps: int, device, scale: float = 1.0) -> dict:
    """One warm-up call, then ``reps`` timed calls (device synced around each): median, min, max, all (x scale)."""
    from tracerl.util import sync

    fn()
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * scale)
    return {"median": statistics.median(times), "min": min(times), "max": max(times), "all": times}


def _print_paths(res: dict, key: str, unit: str, digits: int, extra) -> None:
    """One line per path: median (min..max) of ``res[f"{path}_{key}"]`` and ``extra(path)``."""
    for name in PATHS:
        t = res[f"{name}_{key}"]
        print(f"  {name:8s} {t['median']:9.{digits}f} {unit} ({t['min']:.{digits}f}..{t['max']:.{digits}f})  "
              f"{extra(name)}")


def layer_bench(device, n: int, hidden: int, inter: int, experts: int, top_k: int, reps: int) -> dict:
    import torch
    import torch.nn.functional as F

    from tracerl.policy import grouped_gemm_supported, routed_experts

    g = torch.Generator().manual_seed(0)
    dt = torch.bfloat16
    x = (torch.randn(n, hidden, generator=g) * 0.5).to(dt).to(device)
    idx = torch.rand(n, experts, generator=g).topk(top_k, dim=-1).indices.sort(dim=-1).values.to(device)
    wts = torch.rand(n, top_k, generator=g).to(dt).to(device)
    w1 = (torch.randn(experts, 2 * inter, hidden, generator=g) * hidden ** -0.5).to(dt).to(device)
    w2 = (torch.randn(experts, hidden, inter, generator=g) * inter ** -0.5).to(dt).to(device)
    probe = torch.randn(n, hidden, generator=g).to(dt).to(device)

    def once():
        xs, ws, a, b = (t.detach().clone().requires_grad_() for t in (x, wts, w1, w2))
        y = routed_experts(xs, idx, ws, a, b, F.silu)
        (y.float() * probe.float()).sum().backward()
        return [y.detach(), xs.grad, ws.grad, a.grad, b.grad]

    out = {"tokens": n, "hidden": hidden, "intermediate": inter, "experts": experts, "top_k": top_k}
    results = {}
    for name in PATHS:
        with _expert_path(name):
            out[f"{name}_runs_grouped_mm"] = grouped_gemm_supported(x, w1)
            out[f"{name}_ms"] = _timed(once, reps, device, scale=1e3)
            runs = [once() for _ in range(3)]
        out[f"{name}_bitwise_reproducible"] = all(torch.equal(p, q) for r in runs[1:] for p, q in zip(runs[0], r))
        results[name] = runs[0]
    names = ("out", "d_x", "d_router_weights", "d_w_gate_up", "d_w_down")
    out["grouped_vs_loop"] = {
        k: {"equal": bool(torch.equal(a, b)),
            "max_abs_diff": float((a.float() - b.float()).abs().max()),
            "max_abs": float(b.float().abs().max())}
        for k, a, b in zip(names, results["grouped"], results["loop"])}
    out["speedup"] = out["loop_ms"]["median"] / out["grouped_ms"]["median"]
    return out


def model_bench(device, spec_kw: dict, seqs: int, seq_len: int, reps: int) -> dict:
    import numpy as np
    import torch

    from tracerl.rollout import RolloutEngine
    from tracerl.policy import TinyMoESpec, build_model
    from tracerl.hints import PackedHints, Segment
    from tracerl.policy import install_fp4
    from tracerl.policy import plan_sites
    from tracerl.train import QATTrainer

    spec = TinyMoESpec(**spec_kw)
    model = build_model(spec, seed=0, device=device).to(torch.bfloat16)
    rt = install_fp4(model, plan_sites(model, hint_layers="latter-half"))
    model.train()
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(1, spec.vocab_size, (seqs, seq_len), generator=g)
    RolloutEngine(model, rt).calibrate([t[:256].tolist() for t in toks])
    packed = PackedHints(segments=tuple(Segment(f"t{i}", 0, seq_len) for i in range(seqs)),
                         cu_seqlens=np.arange(seqs + 1) * seq_len, token_ids=toks.reshape(-1).numpy(),
                         positions=np.tile(np.arange(seq_len), seqs), logprobs=np.zeros(seqs * seq_len, np.float32),
                         hints={}, scales={}, experts={}, features=None)
    tr = QATTrainer(model, rt)
    out = {"tokens": seqs * seq_len, "layers": spec.num_layers, "experts": spec.num_experts}
    for name in PATHS:
        with _expert_path(name):
            out[f"{name}_s"] = _timed(lambda: tr.recompute(packed, "fp4_rne_own_scales", backward=True,
                                                           observe=False), reps, device)
        out[f"{name}_tokens_per_s"] = seqs * seq_len / out[f"{name}_s"]["median"]
    out["speedup"] = out["loop_s"]["median"] / out["grouped_s"]["median"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (checks the code path)")
    p.add_argument("--reps", type=int, default=5, help="timed calls per path (default 5; medians reported)")
    p.add_argument("--no-model", action="store_true", help="skip the whole-model measurement")
    p.add_argument("--out", help="JSON file (default $OUT/expert-gemm.json, or ./expert-gemm.json)")
    args = p.parse_args(argv)
    if args.reps < 3:
        p.error(f"--reps {args.reps}: at least 3 (medians of at least 3 runs)")
    import torch

    if args.smoke:
        device = torch.device("cpu")
        layer = dict(n=256, hidden=64, inter=32, experts=8, top_k=2)
        spec = dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32, num_experts=8, top_k=2,
                    moe_intermediate_size=32, vocab_size=256)
        seqs, seq_len = 2, 64
    else:
        if not torch.cuda.is_available():
            p.error("the full benchmark needs a CUDA device; use --smoke on the CPU")
        from benchmark_audit import GPU_SPEC

        device = torch.device("cuda")
        layer = dict(n=8192, hidden=2048, inter=512, experts=32, top_k=4)
        spec, seqs, seq_len = dict(GPU_SPEC), 2, 4096
    res = {"benchmark": "expert_gemm", "layer": layer_bench(device, **layer, reps=args.reps)}
    lay = res["layer"]
    print(f"MoE layer fwd+bwd ({lay['tokens']} tokens, H {lay['hidden']}, I {lay['intermediate']}, "
          f"{lay['experts']} experts top-{lay['top_k']}), median of {args.reps}:")
    _print_paths(lay, "ms", "ms", 2, lambda n: f"bitwise reproducible: {lay[f'{n}_bitwise_reproducible']}  "
                                               f"grouped_mm: {lay[f'{n}_runs_grouped_mm']}")
    print(f"  speedup {lay['speedup']:.2f}x; grouped vs loop: " + ", ".join(
        f"{k} {'equal' if v['equal'] else 'max|diff| %.3g (of %.3g)' % (v['max_abs_diff'], v['max_abs'])}"
        for k, v in lay["grouped_vs_loop"].items()))
    if not args.no_model:
        res["model"] = model_bench(device, spec, seqs, seq_len, args.reps)
        m = res["model"]
        print(f"whole model ({m['layers']} layers, {m['experts']} experts) fwd+bwd of {m['tokens']} tokens, "
              f"median of {args.reps}:")
        _print_paths(m, "s", "s", 3, lambda n: f"{m[f'{n}_tokens_per_s']:8.0f} tok/s")
        print(f"  speedup {m['speedup']:.2f}x")
    res["machine"] = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
                      "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                      "code_version": os.environ.get("BENCHMARK_CODE_VERSION")}
    out = Path(args.out or os.path.join(os.environ.get("OUT", "."), "expert-gemm.json"))
    out.write_text(json.dumps(res, indent=1))
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
