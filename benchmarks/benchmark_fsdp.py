"""The FSDP2 trainer against one unsharded process on the same store: per-rank parameter + gradient + AdamW bytes,
seconds per step, and the loss, gradient norm and code agreement against world size 1.

Each configuration runs ``tracerl train`` on one store (``--steps`` steps, no checkpoints or publication after step 0:
what is measured is the step): ``plain`` is one process without torchrun (bf16 weights + fp32 masters), ``fsdp-N``
is ``torchrun --nproc-per-node N`` (gloo on the CPU, NCCL on GPUs: FSDP2-sharded fp32 weights, bf16 compute;
``fsdp-1`` too: torchrun at one rank runs the same sharded path, fully_shard over a mesh of one). The
store is recorded once (a loop store; every batch by policy version 0, so later steps also measure stale groups
with the kept weights swapped in). Step times are the medians over steps 2.. (the first step warms up) of each run,
then the median and spread (min..max) over ``--runs`` runs. State bytes are the last step's, per rank.

    python benchmarks/benchmark_fsdp.py                         # CPU: plain, fsdp-1, fsdp-2, fsdp-4; 3 runs
    python benchmarks/benchmark_fsdp.py --smoke                 # tiny and short: checks the code paths
    python benchmarks/benchmark_fsdp.py --device cuda --configs plain,fsdp-1 --runs 3   # one GPU, the H200 model

Saves JSON (machine, versions, sizes, every run's per-step metrics) to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO, os.environ.get("PYTHONPATH", "")) if p)

GPU_SPEC = dict(hidden_size=2048, num_layers=40, num_heads=16, num_kv_heads=4, head_dim=128, num_experts=32,
                top_k=4, moe_intermediate_size=512, max_position_embeddings=16384)
CPU_SPEC = dict(hidden_size=128, num_layers=4, num_experts=8)  # top-2, intermediate 128 (TinyMoESpec defaults)
SMOKE_SPEC = dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32, num_experts=8,
                  moe_intermediate_size=32)
TASK = {"name": "target-set", "alphabet": 8, "prompt_len": 3, "response_len": 8}


def _store(url: str, spec: dict, args) -> None:
    """A loop store with ``steps`` batches of ``groups`` x ``group_size`` trajectories, all by version 0."""
    import tracestore as ts
    from tracerl.artifacts import weights
    from tracerl.config import RolloutConfig
    from tracerl.loop import create_loop_store
    from tracerl.policy import TinyMoESpec, build_policy, make_task
    from tracerl.rollout import RolloutWorker, run_rollout

    task = make_task(**{**TASK, "response_len": args.response_len})
    margin = getattr(args, "margin", None)  # benchmark_trainer --margin: the hinted sites as margin-exception rows
    store = create_loop_store(url, TinyMoESpec(**spec, vocab_size=task.vocab_size), task, hint_layers=args.hint_layers,
                              calibration_prompts=32, device=args.device, margin=margin,
                              margin_coding=getattr(args, "margin_coding", "gamma:bitmap"))
    # version 0 as the trainer builds it: on the trainer's device (the seeded init differs between CPU and CUDA)
    weights.publish(url, 0, build_policy(store.model, args.device).model.state_dict())
    cfg = RolloutConfig(groups_per_batch=args.groups, group_size=args.group_size, max_ahead=args.steps,
                        record_codes=True)
    with RolloutWorker(ts.open_store(url), cfg, device=args.device) as worker:
        run_rollout(worker, max_batches=args.steps)


def record_store(url: str, spec: dict, args) -> None:
    """`_store` in a spawned process, so this one holds no device memory while the trainers it starts run (on CUDA
    the rollout's model, graphs and cached blocks took 17.6 GiB beside the trainer: an OOM on an 80 GB card)."""
    import multiprocessing

    p = multiprocessing.get_context("spawn").Process(target=_store, args=(url, spec, args), name="record-store")
    p.start()
    p.join()
    if p.exitcode != 0:
        raise SystemExit(f"recording the store failed (exit code {p.exitcode}; its traceback is above)")


def _train(config: str, url: str, run_dir: Path, args) -> list[dict]:
    metrics = run_dir / "train.jsonl"
    cmd = ["-m", "tracerl.cli", "train", url, "--checkpoints", str(run_dir), "--metrics", str(metrics),
           "--steps", str(args.steps), "--groups-per-step", str(args.groups), "--group-size", str(args.group_size),
           "--micro-batch-tokens", str(args.micro_batch_tokens), "--max-staleness", str(args.steps),
           "--no-publish", "--checkpoint-every", "0", "--device", args.device, "--wait-timeout", "120",
           "--threads", str(args.threads)]
    if args.time_phases:
        cmd.append("--time-phases")
    if config == "plain":
        argv = [sys.executable, *cmd]
    else:
        n = int(config.split("-")[1])
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), *cmd]
    t0 = time.perf_counter()
    p = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout)
    if p.returncode != 0:
        raise SystemExit(f"{config}: tracerl train failed:\n{p.stderr[-3000:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    for r in rows:
        r["wall_s_process"] = time.perf_counter() - t0
    return rows


def _phases(reps: list[list[dict]]) -> dict[str, float] | None:
    """Per phase, the median over runs of its median over steps 2.. (None without --time-phases)."""
    rows = [r for rows in reps for r in (rows[1:] or rows) if r.get("phases_s")]
    if not rows:
        return None
    names = dict.fromkeys(k for r in rows for k in r["phases_s"])
    return {k: statistics.median(r["phases_s"].get(k, 0.0) for r in rows) for k in names}


def _summary(runs: dict[str, list[list[dict]]]) -> dict[str, dict]:
    base = runs.get("plain") or next(iter(runs.values()))
    out = {}
    for config, reps in runs.items():
        step_s = [statistics.median(r["step_s"] for r in rows[1:] or rows) for rows in reps]
        last = reps[0][-1]
        ranks = last["rank_state_bytes"]
        ref = base[0]
        out[config] = {
            "step_s_median": statistics.median(step_s), "step_s_min": min(step_s), "step_s_max": max(step_s),
            "world_size": last["world_size"], "sharded": last["sharded"],
            "per_rank_bytes": [r["params"] + r["grads"] + r["optim"] for r in ranks],
            "per_rank": ranks,
            "cuda_max_allocated_gib": (None if last.get("cuda_max_allocated_bytes") is None
                                       else last["cuda_max_allocated_bytes"] / 2**30),
            "max_rel_loss_diff": max(abs(a["loss"] - b["loss"]) / max(abs(b["loss"]), 1e-30)
                                     for a, b in zip(reps[0], ref)),
            "max_rel_grad_norm_diff": max(abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"]
                                          for a, b in zip(reps[0], ref)),
            "code_agreement": [a["mismatch"]["code_agreement"] for a in reps[0]],
            "code_agreement_ref": [b["mismatch"]["code_agreement"] for b in ref],
            "digests_equal_to_ref": [a["digest"] == b["digest"] for a, b in zip(reps[0], ref)],
            "reduce_s_median": statistics.median(statistics.median(r["reduce_s"] for r in rows[1:] or rows)
                                                 for rows in reps),
            "compute_s_median": statistics.median(statistics.median(r["compute_s"] for r in rows[1:] or rows)
                                                  for rows in reps),
            "phases_s_median": _phases(reps),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="plain,fsdp-1,fsdp-2,fsdp-4", metavar="LIST",
                    help="comma-separated: plain (one process) and fsdp-N (torchrun, N ranks) (default: plain, 1, 2, 4)")
    ap.add_argument("--runs", type=int, default=3, metavar="N", help="runs per configuration (default 3)")
    ap.add_argument("--steps", type=int, default=4, metavar="N", help="training steps per run (default 4)")
    ap.add_argument("--device", default="cpu", metavar="DEVICE", help="cpu (default) or cuda (one GPU)")
    ap.add_argument("--groups", type=int, default=4, metavar="P", help="GRPO groups per step (default 4)")
    ap.add_argument("--group-size", type=int, default=8, metavar="G", help="trajectories per group (default 8)")
    ap.add_argument("--response-len", type=int, default=8, metavar="N", help="response tokens (default 8)")
    ap.add_argument("--micro-batch-tokens", type=int, default=64, metavar="N", help="tokens per micro-batch (default 64)")
    ap.add_argument("--hint-layers", default="latter-half", metavar="LAYERS", help="hinted layers (default latter-half)")
    ap.add_argument("--threads", type=int, default=1, metavar="N", help="torch CPU threads per process (default 1)")
    ap.add_argument("--timeout", type=int, default=1800, metavar="S", help="seconds per run at most (default 1800)")
    ap.add_argument("--time-phases", action="store_true",
                    help="time the trainer's phases (a device sync each; summary.phases_s_median says where a step goes)")
    ap.add_argument("--smoke", action="store_true", help="tiny model, 1 run, 2 steps, plain and fsdp-2")
    ap.add_argument("--out", metavar="PATH", help="JSON output (default benchmarks/results/fsdp-<device>.json; "
                                                  "--smoke: a temporary file)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.runs, args.steps, args.configs, args.groups, args.group_size = 1, 2, "plain,fsdp-2", 2, 4
    spec = SMOKE_SPEC if args.smoke else (GPU_SPEC if args.device.startswith("cuda") else CPU_SPEC)
    if args.device.startswith("cuda"):
        args.response_len, args.micro_batch_tokens = max(args.response_len, 128), max(args.micro_batch_tokens, 2048)
    configs = args.configs.split(",")
    out = Path(args.out or (Path(tempfile.mkdtemp(prefix="fsdp-smoke-")) / "fsdp.json" if args.smoke else
                            Path(_REPO) / "benchmarks" / "results" / f"fsdp-{args.device.split(':')[0]}.json"))
    from tracerl.runlog import machine_info

    def save(runs: dict[str, list[list[dict]]]) -> dict[str, dict]:
        """The JSON so far (after every run: a run cut short by a time limit keeps the finished ones)."""
        summary = _summary(runs)
        result = {"machine": machine_info(), "spec": spec, "device": args.device, "args": vars(args),
                  "summary": summary, "runs": runs}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1, default=str))
        return summary

    with tempfile.TemporaryDirectory() as tmp:
        url = f"{tmp}/store"
        t0 = time.perf_counter()
        record_store(url, spec, args)
        print(f"store recorded in {time.perf_counter() - t0:.1f}s: {args.steps} batches of {args.groups} x "
              f"{args.group_size}", file=sys.stderr)
        runs: dict[str, list[list[dict]]] = {}
        for rep in range(args.runs):
            for config in configs:  # interleaved, so a slow moment of the machine hits every configuration
                rows = _train(config, url, Path(tmp) / f"{config}-{rep}", args)
                runs.setdefault(config, []).append(rows)
                print(f"run {rep + 1}/{args.runs} {config}: step_s {[round(r['step_s'], 3) for r in rows]}",
                      file=sys.stderr, flush=True)
                summary = save(runs)
    print(f"{'config':<8} {'ranks':>5} {'step s (min..max)':>22} {'per-rank state MiB':>24} {'rel loss':>9} "
          f"{'rel |g|':>9} {'code agr.':>10}")
    for config, s in summary.items():
        mib = "/".join(f"{b / 2**20:.1f}" for b in s["per_rank_bytes"])
        agr = s["code_agreement"][-1]
        print(f"{config:<8} {s['world_size']:>5} {s['step_s_median']:>9.3f} ({s['step_s_min']:.3f}..{s['step_s_max']:.3f})"
              f" {mib:>24} {s['max_rel_loss_diff']:>9.1e} {s['max_rel_grad_norm_diff']:>9.1e} "
              f"{'-' if agr is None else f'{agr:.5f}':>10}")
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
