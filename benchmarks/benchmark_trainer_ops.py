"""How many torch operations one trainer step issues, and how that grows with the number of experts.

The closed loop's trainer ran at 290-540 tok/s on an H200 with the GPU 10-22% busy (`loop-cuda-1gpu.json`): a
step that is bound by issuing operations, not by the device. This counts the top-level ``aten::`` operations of
one `GRPOTrainer` step (torch.profiler, CPU) for MoE models that differ only in their number of experts, and
reports the operations per expert per layer: the part a grouped expert path would remove. The CPU runs the torch
reference FP4 kernels, so the absolute counts differ from a GPU run; the per-expert growth is the same code path.
The counts are deterministic (one run says it all; the profiled seconds are not a speed figure).

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
        run_rollout(w, metrics=MetricsLog(None), max_batches=2)
    run_training(trainer, follower, checkpoints=ck, weights_url=url, metrics=log, max_steps=1)  # warm-up
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run_training(trainer, follower, checkpoints=ck, weights_url=url, metrics=log, max_steps=2)
    seconds = time.perf_counter() - t0
    top = [e for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None]
    step = log.records()[-1]
    return {"experts": experts, "layers": layers, "top_k": spec.top_k, "ops": len(top),
            "trajectories": step["trajectories"], "tokens": step["tokens"], "profiled_seconds": seconds,
            "most_common": collections.Counter(e.name for e in top).most_common(10)}


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
    print(f"{'experts':>7} {'layers':>6} {'tokens':>6} {'aten ops / step':>16}  most common")
    for r in rows:
        common = ", ".join(f"{n.removeprefix('aten::')} {c}" for n, c in r["most_common"][:4])
        print(f"{r['experts']:>7} {r['layers']:>6} {r['tokens']:>6} {r['ops']:>16}  {common}")
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
