"""The closed RL loop across processes: reward, commit-to-train lag, throughput, and the rollout/trainer mismatch
per policy update in ``fp4_hints`` vs ``fp4_rne_own_scales`` (the paper's claim in miniature: hints keep the
mismatch low through training), plus a bitwise replay of one run.

Each run is `tracerl.loop.run_loop`: a fresh loop store, one ``tracerl rollout`` process and one ``tracerl
train`` process (rollout one version ahead: ``max_ahead`` 2, ``max_staleness`` 1, so generation and training
overlap; the mismatch of the groups trained one version late is measured with the weights that generated them),
``--steps`` policy updates. The same seed gives both modes the same initial weights, prompts and sampling seeds.
After the runs, the first run of the first mode is replayed from its checkpoint 0 on the trainer's device
(`tracerl.loop.replay.replay`, ``--replay-steps``) and compared bit for bit with its live log.

    python benchmarks/benchmark_loop.py                       # CPU (2 processes), 3 seeds x 2 modes, 20 steps
    python benchmarks/benchmark_loop.py --smoke               # tiny and short: checks the code paths
    python benchmarks/benchmark_loop.py --device cuda --seeds 0 --modes fp4_hints --replay-steps 10
                                                              # GPU: rollout on cuda:0, trainer on cuda:1
    python benchmarks/benchmark_loop.py --device cuda --gpus 1 --seeds 0 --replay-steps 0
                                                              # one GPU: both processes on cuda:0 ("cuda-1gpu")
    python benchmarks/benchmark_loop.py --device cuda --gpus 1 --seeds 0 --replay-steps 0 --modes fp4_hints,fp4_hints+nocodes
                                                              # the same with and without the rollout's codes (the
                                                              # trainer's code comparison: its cost to the loop)

GPU model: the H200 fidelity runs' (hidden 2048, 40 layers, 32 experts top-4; benchmarks/benchmark_tracerl_h200.py)
with the task's 10-token vocabulary, 8 prompts (4 when both processes share one GPU) x 8 samples x 128 response
tokens per step, the trainer's default micro-batches (8,192 tokens: a step is one) (a random-init policy over a 32K vocabulary would
almost never emit a task symbol, leaving GRPO no signal); hints at the MoE input of the latter 20 layers. The
trainer checkpoints only at step 0, the replay's start, and not at all with ``--replay-steps 0`` (a full
checkpoint of this model is ~60 GB), and keeps the 2 newest policy versions.

Results accumulate in the JSON at --out (runs keyed by mode, seed and device; re-running a key replaces it), so a
GPU session can run one mode per command (``--merge A.json B.json --out C.json`` joins files from separate runs); the table covers every run in the file: per mode the median over seeds
(min..max) of the reward over the first and last 3 steps, lag median and p99, rollout and trainer tokens/s, and
the mismatch (code agreement, mean |dlogp|, k3: medians over the steps). A PNG beside the JSON plots reward and
mismatch per step for every run.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS for the replay, before CUDA
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)
# the loop's child processes (python -m tracerl.cli ...) import this checkout too, whatever their working directory
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO, os.environ.get("PYTHONPATH", "")) if p)

from tracerl.config import LoopConfig  # noqa: E402

GPU_SPEC = dict(hidden_size=2048, num_layers=40, num_heads=16, num_kv_heads=4, head_dim=128, num_experts=32,
                top_k=4, moe_intermediate_size=512, max_position_embeddings=16384)
CPU_SPEC = dict(hidden_size=128, num_layers=4)  # 16 experts top-2 (TinyMoESpec defaults)
SMOKE_SPEC = dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32, num_experts=8,
                  moe_intermediate_size=32)
MODES = ("fp4_hints", "fp4_rne_own_scales")


def _settings(args) -> dict:
    """Model, task and batch settings of --smoke / CPU / GPU (the command line overrides steps and sizes)."""
    if args.device == "cuda":
        dev = ("cuda:0", "cuda:1") if args.gpus == 2 else ("cuda:0", "cuda:0")
    else:
        dev = ("cpu", "cpu")
    if args.smoke:  # with --device cuda: the tiny model on the GPU(s) (checks the GPU code paths)
        return dict(spec=SMOKE_SPEC, response_len=8, groups=2, group=4, steps=3, hint_layers="all",
                    micro=256, lr=1e-3, rollout_device=dev[0], trainer_device=dev[1], extra_train=())
    if args.device == "cuda":
        # a full checkpoint of this model is ~60 GB: only checkpoint 0, and only when the replay needs it (one H200's
        # machine has a 64 GB disk)
        every = "1000000" if args.replay_steps > 0 else "0"
        two = args.gpus == 2
        return dict(spec=GPU_SPEC, response_len=128, groups=8 if two else 4, group=8, steps=20, hint_layers="latter-half",
                    micro=None, lr=1e-5, rollout_device=dev[0], trainer_device=dev[1],
                    extra_train=("--checkpoint-every", every, "--keep-versions", "2"))
    return dict(spec=CPU_SPEC, response_len=16, groups=8, group=8, steps=20, hint_layers="latter-half",
                micro=2048, lr=1e-3, rollout_device="cpu", trainer_device="cpu", extra_train=())


def _device_label(args) -> str:
    """cpu, cuda (rollout and trainer on two GPUs) or cuda-1gpu (both on one GPU)."""
    return "cuda-1gpu" if args.device == "cuda" and args.gpus == 1 else args.device


def _micro(args, s: dict) -> dict:
    """The trainer's micro-batch size: the command line's, the setting's, or (GPU) the loop's own default."""
    micro = args.micro_batch_tokens or s["micro"]
    return {} if micro is None else {"micro_batch_tokens": micro}


def _qat_mode(mode: str) -> tuple[str, bool]:
    """``--modes`` entry ``MODE[+nocodes]`` -> (the QAT mode, whether the rollout records its codes)."""
    qat, plus, what = mode.partition("+")
    if plus and what != "nocodes":
        raise ValueError(f"--modes {mode}: the part after '+' can only be 'nocodes'")
    return qat, not plus


def _config(args, s: dict, mode: str, seed: int, run_dir: str) -> LoopConfig:
    qat, codes = _qat_mode(mode)
    return LoopConfig(
        run_dir=run_dir, steps=args.steps or s["steps"], rollouts=1,
        task={"name": "target-set", "alphabet": 8, "prompt_len": 3, "response_len": args.response_len or s["response_len"]},
        spec=s["spec"], hint_layers=s["hint_layers"], mode=qat, groups_per_step=args.groups or s["groups"],
        group_size=s["group"], lr=args.lr or s["lr"], max_staleness=1, max_ahead=2,
        **_micro(args, s),
        record_codes=codes, seed=seed, rollout_device=s["rollout_device"], trainer_device=s["trainer_device"],
        threads=args.threads, extra_train_args=tuple(s["extra_train"]) + (
            () if args.read_ahead_mb is None else ("--read-ahead-mb", str(args.read_ahead_mb))) + (
            ("--time-phases",) if _time_phases(args) else ()) + (("--replay-routes",) if args.replay_routes else ()) + (
            "--measure-stale-every", str(args.measure_stale_every)))


def _time_phases(args) -> bool:
    """The trainer times its phases on the GPU by default (a few device syncs per micro-batch, next to the host
    reads of log-probs and codes the trainer makes anyway), on the CPU only when asked."""
    return args.time_phases if args.time_phases is not None else args.device == "cuda"


def _med(xs: list) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    m = statistics.median(xs)
    fmt = ".2e" if abs(m) < 1e-2 and m != 0 else ".3f"
    return f"{m:{fmt}} ({min(xs):{fmt}}..{max(xs):{fmt}})"


def table(doc: dict) -> str:
    keys = [("reward_start", "reward first 3"), ("reward_end", "reward last 3"), ("lag_s_median", "lag median s"),
            ("lag_s_p99", "lag p99 s"), ("ready_lag_s_median", "ready lag median s"),
            ("rollout_tokens_per_s_median", "rollout tok/s"),
            ("trainer_tokens_per_s_median", "trainer tok/s"), ("code_agreement_median", "code agreement"),
            ("mismatch_mean_abs_dlogp_median", "mean |dlogp|"), ("mismatch_k3_median", "k3")]
    groups: dict[tuple, list] = {}
    for run in doc["runs"].values():
        groups.setdefault((run["device"], run["mode"]), []).append(run["result"]["summary"])
    lines = [f"{'device':<6} {'mode':<20} {'runs':>4}  " + "  ".join(f"{h:>26}" for _, h in keys)]
    for (device, mode), sums in sorted(groups.items()):
        lines.append(f"{device:<6} {mode:<20} {len(sums):>4}  " + "  ".join(f"{_med([s.get(k) for s in sums]):>26}"
                                                                           for k, _ in keys))
    lines += paired(doc)
    for name, run in doc["runs"].items():
        r = run.get("replay")
        if r:
            lines.append(f"replay of {name} from checkpoint {r['from_step']}: {r['steps']} steps, bitwise_equal="
                         f"{r['bitwise_equal']}, first_divergence={r['first_divergence']}")
    return "\n".join(lines)


def paired(doc: dict) -> list[str]:
    """fp4_hints vs fp4_rne_own_scales of the same device and seed, over the steps both ran: the mean |dlogp|
    ratio per step (hints / RNE) and in how many steps hints had the smaller mismatch."""
    lines = []
    runs = doc["runs"].values()
    for h in (r for r in runs if r["mode"] == "fp4_hints"):
        for o in (r for r in runs if r["mode"] == "fp4_rne_own_scales" and (r["device"], r["seed"]) ==
                  (h["device"], h["seed"])):
            a = {x["step"]: x["mismatch_mean_abs_dlogp"] for x in h["result"]["steps"]}
            b = {x["step"]: x["mismatch_mean_abs_dlogp"] for x in o["result"]["steps"]}
            common = sorted(k for k in set(a) & set(b) if a[k] is not None and b[k])
            if common:
                ratios = [a[k] / b[k] for k in common]
                lines.append(f"{h['device']} seed {h['seed']}: over the {len(common)} steps both modes ran, hints have "
                             f"the smaller mean |dlogp| in {sum(x < 1 for x in ratios)}; ratio hints/RNE median "
                             f"{statistics.median(ratios):.3f} ({min(ratios):.3f}..{max(ratios):.3f})")
    return lines


def plot_all(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for name, run in sorted(doc["runs"].items()):
        rows = run["result"]["steps"]
        x = [r["step"] for r in rows]
        style = "-" if run["mode"] == "fp4_hints" else "--"
        axes[0].plot(x, [r["reward"] for r in rows], style, label=name)
        # the mismatch of the steps that measured it (with --measure-stale-every N > 1 one in N), joined, marked
        for ax, get in ((axes[1], lambda r: r["mismatch_mean_abs_dlogp"]),
                        (axes[2], lambda r: None if r["mismatch_code_agreement"] is None
                         else 1 - r["mismatch_code_agreement"])):
            pts = [(r["step"], v) for r in rows if (v := get(r)) is not None and math.isfinite(v)]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker=".", label=name)
    axes[0].set(title="reward (mean per step)", xlabel="policy update")
    axes[1].set(title="mean |logp_trainer - logp_rollout|", xlabel="policy update")
    axes[2].set(title="1 - code agreement at hinted sites", xlabel="policy update")
    for a in axes[1:]:
        a.set_yscale("symlog", linthresh=1e-6)  # log scale with a linear stretch around an exact 0
    axes[0].legend(fontsize=6)
    fig.suptitle("closed loop: fp4_hints (solid) vs fp4_rne_own_scales (dashed)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _code_version() -> str:
    import subprocess

    try:
        here = os.path.dirname(os.path.abspath(__file__))
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (head + ("+changes" if dirty else "")) or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true",
                   help="tiny model, 3 steps (checks the code paths; on the GPUs with --device cuda)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cpu: both processes on the CPU; cuda: rollout on cuda:0, trainer on cuda:1 (see --gpus)")
    p.add_argument("--gpus", type=int, choices=(1, 2),
                   help="with --device cuda: 2 puts the trainer on cuda:1, 1 puts both processes on cuda:0 (runs are "
                        "then labelled cuda-1gpu, and a step trains 4 prompts instead of 8 by default); default: 2 when "
                        "two GPUs are visible, else 1")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated QAT modes (default {','.join(MODES)}); MODE+nocodes: the rollout records no "
                        "codes (as `tracerl loop --no-record-codes`), so the trainer compares none and reports no code "
                        "agreement: what the comparison costs the loop, e.g. fp4_hints,fp4_hints+nocodes")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds; every mode runs once per seed")
    p.add_argument("--steps", type=int, help="policy updates per run (default 20; smoke 3)")
    p.add_argument("--groups", type=int, help="prompts per step (default 8; one GPU 4; smoke 2)")
    p.add_argument("--response-len", type=int, help="response tokens (default: CPU 16, GPU 128, smoke 8)")
    p.add_argument("--micro-batch-tokens", type=int,
                   help="trainer micro-batch tokens (default: CPU 2048, smoke 256, GPU the loop's own default, "
                        f"{LoopConfig.micro_batch_tokens})")
    p.add_argument("--read-ahead-mb", type=int,
                   help="the trainer's --read-ahead-mb (default: the trainer's, 256; 0 reads one micro-batch at a time)")
    p.add_argument("--time-phases", action=argparse.BooleanOptionalAction,
                   help="the trainer's --time-phases: seconds per phase of each step in the results (default: on "
                        "with --device cuda)")
    p.add_argument("--lr", type=float, help="AdamW learning rate (default: CPU 1e-3, GPU 1e-5, smoke 1e-3)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    p.add_argument("--measure-stale-every", type=int, default=1, metavar="N",
                   help="the trainer's --measure-stale-every (default here 1, not the trainer's 4: this benchmark "
                        "reports the mismatch of every step, and the loop trains groups one version late)")
    p.add_argument("--replay-routes", action="store_true",
                   help="the trainer replays the rollout's routed experts (routing replay, R3) in every mode")
    p.add_argument("--replay-steps", type=int, default=10,
                   help="replay this many steps of the first run (0: no replay; default 10)")
    p.add_argument("--keep", metavar="DIR", help="keep the run directories below DIR (default: temporary)")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="only merge the runs of these result files into --out, print the table and the plot")
    p.add_argument("--from-run", nargs="+", metavar="DIR",
                   help="only add the runs in these run directories (named <device>-<mode>-seed<N>, holding train.jsonl "
                        "and rollout-*.jsonl) to --out: for a loop cut short by a time limit before it returned")
    p.add_argument("--out", help="JSON results (default benchmarks/results/loop-<device>.json, smoke: "
                                 "loop-smoke.json in a temporary directory)")
    args = p.parse_args(argv)
    if args.gpus is not None and args.device != "cuda":
        p.error("--gpus needs --device cuda")
    if args.device == "cuda" and not (args.merge or args.from_run):
        import torch

        visible = torch.cuda.device_count()
        if args.gpus is None:
            args.gpus = 2 if visible >= 2 else 1
        if visible < args.gpus:
            p.error(f"--device cuda --gpus {args.gpus}: {visible} CUDA device(s) visible")
    s = _settings(args)
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        try:
            _qat_mode(m)
        except ValueError as e:
            p.error(str(e))
    seeds = [int(x) for x in args.seeds.split(",") if x]
    device = _device_label(args)
    default_out = (Path(tempfile.gettempdir()) / f"loop-smoke-{device}.json" if args.smoke
                   else Path(__file__).resolve().parent / "results" / f"loop-{device}.json")
    out = Path(args.out) if args.out else default_out
    doc = json.loads(out.read_text()) if out.exists() else {"runs": {}}
    if args.from_run:
        from tracerl.loop import summarize
        from tracerl.runlog import MetricsLog, json_ready

        for d in map(Path, args.from_run):
            m = re.fullmatch(r"(cpu|cuda|cuda-1gpu)-(\w+)-seed(\d+)", d.name)
            if m is None or not (d / "train.jsonl").is_file():
                p.error(f"--from-run {d}: needs a run directory named <cpu|cuda|cuda-1gpu>-<mode>-seed<N> holding "
                        "train.jsonl")
            dev, mode, seed = m.groups()
            mode = mode.removesuffix("_nocodes") + ("+nocodes" if mode.endswith("_nocodes") else "")
            steps = MetricsLog(d / "train.jsonl").records()
            batches = [r for f in sorted(d.glob("rollout-*.jsonl")) for r in MetricsLog(f).records()]
            result = summarize(None, steps, batches)
            result.update(store=None, wall_s=None, stopped_early=True)
            doc["runs"][d.name] = {"device": dev, "mode": mode, "seed": int(seed), "result": result, "replay": None,
                                   "run_dir": None, "code": os.environ.get("BENCHMARK_CODE_VERSION"),
                                   "command": f"summarized from {d.name}/train.jsonl: the loop was stopped by a time "
                                              f"limit after {len(steps)} steps"}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(json_ready(doc), indent=1))
        print(table(doc))
        plot_all(doc, out.with_suffix(".png"))
        print(f"saved {out} and {out.with_suffix('.png')}")
        return 0
    if args.merge:
        for path in args.merge:
            doc["runs"].update(json.loads(Path(path).read_text())["runs"])
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1))
        print(table(doc))
        plot_all(doc, out.with_suffix(".png"))
        print(f"saved {out} and {out.with_suffix('.png')}")
        return 0

    from tracerl.loop import run_loop
    from tracerl.loop import replay
    from tracerl.runlog import MetricsLog, json_ready

    base = args.keep or tempfile.mkdtemp(prefix="benchmark-loop-")
    code = os.environ.get("BENCHMARK_CODE_VERSION") or _code_version()
    first = None
    for mode in modes:
        for seed in seeds:
            name = f"{device}-{mode.replace('+', '_')}-seed{seed}"
            run_dir = os.path.join(base, name)
            cfg = _config(args, s, mode, seed, run_dir)
            t0 = time.time()
            print(f"{name}: {cfg.steps} steps ...", flush=True)
            result = run_loop(cfg)
            sm = result["summary"]
            print(f"  {time.time() - t0:.0f}s: reward {sm['reward_start']:.3f} -> {sm['reward_end']:.3f}, lag median "
                  f"{sm['lag_s_median']:.2f}s p99 {sm['lag_s_p99']:.2f}s, code agreement {sm['code_agreement_median']}, "
                  f"mean |dlogp| {sm['mismatch_mean_abs_dlogp_median']}", flush=True)
            if sm.get("phases_s_median"):
                print("  trainer step phases, median s: " + ", ".join(f"{k} {v:.3f}" for k, v in
                                                                   sm["phases_s_median"].items())
                      + f" (step {sm['step_s_median']:.3f})", flush=True)
            doc["runs"][name] = {"device": device, "mode": mode, "seed": seed, "result": result, "replay": None,
                                 "run_dir": run_dir if args.keep else None, "code": code,
                                 "command": " ".join(sys.argv)}
            if first is None:
                first = (name, cfg, result)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(json_ready(doc), indent=1))
    if first is not None and args.replay_steps > 0:
        import tracestore as ts

        name, cfg, result = first
        t0 = time.time()
        live = MetricsLog(Path(cfg.run_dir) / "train.jsonl").records()
        r = replay(ts.open_store(result["store"]), str(Path(cfg.run_dir)), live, step=0,
                   max_steps=args.replay_steps, device=cfg.trainer_device)
        r["seconds"] = time.time() - t0
        r["device"] = cfg.trainer_device
        doc["runs"][name]["replay"] = r
        print(f"replay of {name}: {r['steps']} steps, bitwise_equal={r['bitwise_equal']} ({r['seconds']:.0f}s)")
        out.write_text(json.dumps(json_ready(doc), indent=1))
    print(table(doc))
    try:
        plot_all(doc, out.with_suffix(".png"))
        print(f"saved {out} and {out.with_suffix('.png')}")
    except ImportError:
        print(f"saved {out} (no plot: matplotlib is not installed)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
