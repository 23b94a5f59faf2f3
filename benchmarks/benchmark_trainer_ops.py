"""How many torch operations one trainer step issues, and how that grows with the number of experts.

The closed loop's trainer ran at 290-540 tok/s on an H200 with the GPU 10-22% busy (`loop-cuda-1gpu.json`): a
step that is bound by issuing operations, not by the device. This counts the top-level ``aten::`` operations of
one `GRPOTrainer` step (torch.profiler, CPU) for MoE models that differ only in their number of experts, and
reports the operations per expert per layer: the part a grouped expert path would remove. The CPU runs the torch
reference FP4 kernels, so the absolute counts differ from a GPU run; the per-expert growth is the same code path.
The counts are deterministic (one run says it all; the profiled seconds are not a speed figure).

A second count of the same step estimates what a GPU launches: the non-view aten operations issued outside
``tracefp4`` (counted with a `TorchDispatchMode`, each attributed to the innermost frame of our code, the model's or
torch's optimizer that issued it) plus one per ``tracefp4`` call (a Triton launch on the GPU, where the CPU runs the
torch reference's dozens of operations). ``--layers 40 --experts 32`` is the H200 model's depth and expert count
(narrow layers: the counts do not depend on the widths).

    python benchmarks/benchmark_trainer_ops.py                 # 2 layers, 8 and 32 experts top-4, a step of 8 trajectories
    python benchmarks/benchmark_trainer_ops.py --smoke         # 2 and 4 experts (checks the code path)
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_REPO))
sys.path.insert(0, str(_REPO / "tests"))


_VIEWS = {"aten.view.default", "aten._unsafe_view.default", "aten.as_strided.default", "aten.t.default",
          "aten.transpose.int", "aten.detach.default", "aten.expand.default", "aten.slice.Tensor", "aten.select.int",
          "aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.default", "aten.permute.default",
          "aten.alias.default", "aten.empty.memory_format", "aten.empty_strided.default", "aten.reshape.default",
          "aten.split.Tensor", "aten.unbind.int", "aten.split_with_sizes.default", "aten.lift_fresh.default",
          "aten._reshape_alias.default", "aten.empty_like.default", "aten.view.dtype"}
_OURS = ("/tracerl/", "/tracestore/", "site-packages/transformers/", "torch/nn/", "torch/optim/")


def _launch_estimate(run) -> dict:
    """Run ``run()`` counting (non-view aten ops outside tracefp4, tracefp4 API calls, the top issuing lines)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import tracefp4
    import tracefp4.api as api

    fp4_dir = str(Path(tracefp4.__file__).resolve().parent)
    calls: collections.Counter = collections.Counter()
    names = ("fake_quantize", "fake_quantize_lsb", "fake_quantize_matrices", "quantize_fake", "quantize", "dequantize")
    saved = {n: getattr(api, n) for n in names}

    def counted(name, fn):
        def wrapper(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapper

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.outside, self.inside, self.lines = 0, 0, collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func) not in _VIEWS:
                f, line, in_fp4 = sys._getframe(1), None, False
                while f is not None:
                    fn = f.f_code.co_filename
                    in_fp4 |= fn.startswith(fp4_dir)
                    if any(o in fn for o in _OURS):
                        line = f"{fn.split('site-packages/')[-1].split(str(_REPO) + '/')[-1]}:{f.f_lineno}"
                        break
                    f = f.f_back
                if in_fp4:
                    self.inside += 1
                else:
                    self.outside += 1
                    self.lines[line] += 1
            return func(*args, **(kwargs or {}))

    for n in names:
        setattr(api, n, counted(n, saved[n]))
        setattr(tracefp4, n, getattr(api, n))
    try:
        mode = Count()
        with mode:
            run()
    finally:
        for n in names:
            setattr(api, n, saved[n])
            setattr(tracefp4, n, saved[n])
    return {"ops_outside_tracefp4": mode.outside, "tracefp4_calls": dict(calls),
            "launch_estimate": mode.outside + sum(calls.values()), "reference_ops_inside_tracefp4": mode.inside,
            "top_lines": mode.lines.most_common(12)}


def count_step(experts: int, layers: int, workdir: str) -> dict:
    """Top-level aten operations of one trainer step (after a warm-up step) on a fresh loop store."""
    import torch

    from helpers import loop  # the test suite's tiny task and configs
    from tracerl.policy import TinyMoESpec
    from tracerl.loop import create_loop_store
    from tracerl.rollout import run_rollout
    from tracerl.policy import make_task
    from tracerl.runlog import MetricsLog
    from tracerl.train import run_training, start_or_resume

    task = make_task(**loop.TASK)
    url = os.path.join(workdir, f"store-{layers}-{experts}")
    spec = TinyMoESpec(hidden_size=128, num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=32,
                       num_experts=experts, top_k=min(4, experts), moe_intermediate_size=64,
                       vocab_size=task.vocab_size)
    store = create_loop_store(url, spec, task, hint_layers="all", calibration_prompts=8)
    ck = os.path.join(workdir, f"ck-{layers}-{experts}")
    log = MetricsLog(os.path.join(workdir, f"train-{layers}-{experts}.jsonl"))
    cfg = loop.train_cfg(max_staleness=5, micro_batch_tokens=4096, groups_per_step=2)
    trainer, follower = start_or_resume(store, cfg, checkpoints=ck, weights_url=url, metrics=log)
    with loop.worker(store, max_ahead=4, record_codes=True) as w:
        run_rollout(w, metrics=MetricsLog(None), max_batches=3)
    run_training(trainer, follower, checkpoints=ck, weights_url=url, metrics=log, max_steps=1)  # warm-up
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run_training(trainer, follower, checkpoints=ck, weights_url=url, metrics=log, max_steps=2)
    seconds = time.perf_counter() - t0
    top = [e for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None]
    step = log.records()[-1]
    est = _launch_estimate(lambda: run_training(trainer, follower, checkpoints=ck, weights_url=url, metrics=log,
                                                max_steps=3))
    return {"experts": experts, "layers": layers, "top_k": spec.top_k, "ops": len(top),
            "trajectories": step["trajectories"], "tokens": step["tokens"], "profiled_seconds": seconds,
            "most_common": collections.Counter(e.name for e in top).most_common(10), **est}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="2 and 4 experts (checks the code path)")
    p.add_argument("--experts", default="8,32", help="comma-separated expert counts (default 8,32)")
    p.add_argument("--layers", type=int, default=2, help="MoE layers (default 2)")
    p.add_argument("--out", help="JSON (default benchmarks/results/trainer-ops-cpu.json; smoke: a temporary file)")
    args = p.parse_args(argv)
    experts = [2, 4] if args.smoke else [int(x) for x in args.experts.split(",") if x]
    if len(experts) < 2:
        p.error("--experts: give at least two counts (the growth per expert is the difference)")
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as workdir:
        rows = [count_step(e, args.layers, workdir) for e in experts]
    lo, hi = rows[0], rows[-1]
    per_expert_layer = (hi["ops"] - lo["ops"]) / ((hi["experts"] - lo["experts"]) * args.layers)
    print(f"{'experts':>7} {'layers':>6} {'tokens':>6} {'aten ops / step':>16} {'GPU launch est.':>16}  most common")
    for r in rows:
        common = ", ".join(f"{n.removeprefix('aten::')} {c}" for n, c in r["most_common"][:4])
        print(f"{r['experts']:>7} {r['layers']:>6} {r['tokens']:>6} {r['ops']:>16} {r['launch_estimate']:>16}  {common}")
    print("top issuing lines (last row): " + "; ".join(f"{ln} {c}" for ln, c in rows[-1]["top_lines"][:6]))
    print(f"operations per expert per layer per step: {per_expert_layer:.1f}")
    out = Path(args.out) if args.out else (Path(tempfile.gettempdir()) / "trainer-ops-smoke.json" if args.smoke else
                                           _REPO / "benchmarks" / "results" / "trainer-ops-cpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "trainer_ops", "rows": rows, "ops_per_expert_per_layer": per_expert_layer,
                               "machine": {"platform": platform.platform(), "python": platform.python_version(),
                                           "torch": torch.__version__, "cpus": os.cpu_count()}}, indent=1))
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
