"""The trainer's step on one device: how fast it runs, where its time goes, and ``fp4_hints`` against ``bf16`` (no
QAT) side by side on the same store.

The store is recorded once (a loop store, ``--steps`` batches of ``--groups`` x ``--group-size`` trajectories, all
by policy version 0, so every step after the first trains on groups of an older version, as a trainer one version
behind its rollout does). The trainer keeps the weights of every ``measure_stale_every``-th version (default 4) and
measures the mismatch of those versions' groups in one extra forward, so a loop has two kinds of steps: one in N
with that forward, N - 1 without. The default ``--steps 8`` measures both: step 1 warms up, step 2 trains version-0
groups at version 1 with the stale forward (version 0 is kept), steps 3..8 the same without it (``--unmeasured-from
3``: the kept weights are dropped before step 3, as if version 0 had not been kept; ``--max-staleness 7`` lets
step 8 still train version-0 groups). Six steps without the stale forward per run: with one (``--steps 3``, the
default before 2026-12-07) the medians of three runs moved by ~0.1 s between sessions on the same code. Reported per mode:
both step times and their mean at the trainer's default N, ``(measured + (N - 1) * unmeasured) / N`` (a step that
copies a kept version's weights, one in N, counts as one without: the copy runs on a side stream during the step).
Each (mode, run) is a fresh process training ``--steps`` steps from scratch with the trainer's default settings
(micro-batch tokens, read-ahead, measurement; no phase clock, whose device syncs cost time); no checkpoints, no
publication. Reported: the median and spread (min..max) over ``--runs`` runs, peak allocated memory, and (CUDA) the
GPU's utilization sampled by ``nvidia-smi`` every 100 ms while steps 2.. run. Where the time goes comes from
``--phase-runs`` more runs per mode with ``time_phases`` (a device sync at each phase boundary): their phase medians,
and their step times beside the timed runs' (the clock's own cost). ``--profile`` adds one more process per mode whose step ``--profile-at``
(default 2) runs under torch.profiler and the next under cProfile: the trace (Chrome JSON, gzipped), the top
operations by device and host time and the Python functions by host time are saved beside ``--out``
(``-profile-*`` for fp4_hints, ``-profile-<mode>-*`` for the others; `benchmarks/profile_summary.py` condenses a trace).

    python benchmarks/benchmark_trainer.py --device cuda                # the H200 model: fp4_hints and bf16, 3 runs
    python benchmarks/benchmark_trainer.py --device cuda --profile      # plus a profiled step
    python benchmarks/benchmark_trainer.py --smoke                      # tiny, CPU: checks the code paths
    python benchmarks/benchmark_trainer.py --device cuda --modes fp4_hints,fp4_hints+margin --margin 0.05:0.05:lsb

``--margin M:MS[:lsb]`` records the hinted sites as margin-exception rows instead (`create_loop_store(margin=)`),
so a step includes decoding them (``--margin-decode``) and the forward's fill-in. What that costs the trainer is
best read side by side: ``--modes fp4_hints,fp4_hints+margin`` records both stores and alternates the two modes'
runs (a drift of the machine hits both alike: on a shared H100 one mode's runs of one invocation spanned
0.21..0.28 s of compute, trainer-h100-l20.json);
the summary's ``fp4_hints_margin_over_plain_*`` are the ratios.

The store records the rollout's FP4 codes at the hinted sites (as the closed loop does by default, `tracerl loop`;
`tracerl rollout` and the SGLang writer record none unless asked), and the trainer compares them with its own
(`TrainConfig.code_agreement`): loading ~85 MB of codes a step on the H200 model, one more pass per hinted site and a
comparison, a measurement a store without codes does not pay for. ``MODE+nocodes`` runs MODE with the comparison
off on the same store, so ``--modes fp4_hints,fp4_hints+nocodes,bf16`` separates the QAT forward's cost from the
measurement's (``fp4_hints_nocodes_over_codes_*``, ``fp4_hints_nocodes_over_bf16_*``).

``--store-dir DIR`` keeps the recorded store(s) under DIR and reuses them in a later invocation with the same recording
settings (a device machine kept warm between calls keeps /tmp: ``--store-dir /tmp/trainer-stores`` saves the ~100 s
of recording the H200 model's store on every call after the first).

Saves JSON (machine, versions, sizes, every run's per-step metrics) to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)
sys.path.insert(0, os.path.join(_REPO, "benchmarks"))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO, os.environ.get("PYTHONPATH", "")) if p)

from benchmark_fsdp import CPU_SPEC, GPU_SPEC, SMOKE_SPEC, record_store  # noqa: E402  the same model and store recipe

from tracerl.config import MARGIN_DECODES, TrainConfig, parse_margins  # noqa: E402  (no torch import)
from tracerl.errors import ConfigError  # noqa: E402

TRAIN_DEFAULTS = TrainConfig()

MODES = ("fp4_hints", "bf16")
DEFAULT_MARGIN = (0.05, 0.05, "lsb")  # the margin point of a +margin mode without --margin


def _margin_arg(text: str) -> tuple[float, float, str]:
    """``M:MS[:lsb]`` -> (margin, scale margin, scale payload), one point of `tracerl.config.parse_margins`."""
    try:
        points = parse_margins(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if len(points) != 1 or points[0][2] not in ("byte", "lsb"):
        raise argparse.ArgumentTypeError(f"expected one point M:MS or M:MS:lsb; got {text!r}")
    return points[0]


def _child(args) -> int:
    """One training run in this process (``--child``): metrics to ``args.metrics``; with ``--profile-step`` that step
    (counted from 1) under torch.profiler, its trace and tables beside ``args.metrics``."""
    import torch

    import tracestore as ts
    from tracerl.config import TrainConfig
    from tracerl.runlog import MetricsLog
    from tracerl.train import run_training, start_or_resume

    torch.set_num_threads(args.threads)
    store = ts.open_store(args.store)
    cfg = TrainConfig(mode=args.mode, groups_per_step=args.groups, group_size=args.group_size,
                      max_staleness=args.max_staleness, checkpoint_every=0, time_phases=args.time_phases,
                      margin_decode=args.margin_decode, code_agreement=not args.no_code_agreement,
                      **({"micro_batch_tokens": args.micro_batch_tokens} if args.micro_batch_tokens else {}))
    log = MetricsLog(args.metrics)
    ck = args.metrics + ".ck"
    trainer, follower = start_or_resume(store, cfg, checkpoints=ck, weights_url=None, metrics=log,
                                        device=args.device)
    kw = dict(checkpoints=ck, weights_url=None, metrics=log, wait_timeout_s=120, read_next=args.read_next)
    if not args.profile_step:
        if 0 < args.unmeasured_from <= args.steps:
            run_training(trainer, follower, max_steps=args.unmeasured_from - 1, **kw)
            # from here on as in a step whose groups' version was not kept (measure_stale_every): no stale forward
            trainer._history.clear()
        run_training(trainer, follower, max_steps=args.steps, **kw)
        return 0
    if 0 < args.unmeasured_from < args.profile_step:
        run_training(trainer, follower, max_steps=args.unmeasured_from - 1, **kw)
        trainer._history.clear()  # the profiled steps run without the stale forward, as the timed ones do
    run_training(trainer, follower, max_steps=args.profile_step - 1, **kw)
    acts = [torch.profiler.ProfilerActivity.CPU]
    if args.device.startswith("cuda"):
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts, record_shapes=False) as prof:
        run_training(trainer, follower, max_steps=args.profile_step, **kw)
    base = args.metrics.removesuffix(".jsonl")
    prof.export_chrome_trace(base + "-trace.json")
    subprocess.run(["gzip", "-f", base + "-trace.json"], check=False)
    dev = "cuda_time_total" if args.device.startswith("cuda") else "cpu_time_total"
    ka = prof.key_averages()
    Path(base + "-top.txt").write_text(ka.table(sort_by=dev, row_limit=60) + "\n\n"
                                       + ka.table(sort_by="cpu_time_total", row_limit=40))
    if args.profile_step < args.steps:  # the next step under cProfile: which Python functions hold the host
        import cProfile
        import io
        import pstats

        prof_py = cProfile.Profile()
        prof_py.enable()
        run_training(trainer, follower, max_steps=args.profile_step + 1, **kw)
        prof_py.disable()
        buf = io.StringIO()
        stats = pstats.Stats(prof_py, stream=buf)
        buf.write(f"step {args.profile_step + 1} under cProfile (its overhead inflates Python-heavy code; "
                  "compare functions with each other, not with the step time)\n")
        stats.sort_stats("cumulative").print_stats(80)
        stats.sort_stats("tottime").print_stats(50)
        Path(base + "-python.txt").write_text(buf.getvalue())
    return 0


class _GpuSampler:
    """``nvidia-smi`` utilization samples (percent, every 100 ms) with their host times; nothing without it."""

    def __init__(self, enabled: bool = True):
        self.samples: list[tuple[float, int]] = []
        self._proc = None
        if enabled and shutil.which("nvidia-smi"):
            self._proc = subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                                           "-lms", "100", "-i", "0"], stdout=subprocess.PIPE, text=True)
            threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self._proc.stdout:
            try:
                self.samples.append((time.time(), int(line.strip())))
            except ValueError:
                pass

    def between(self, t0: float, t1: float) -> list[int]:
        return [u for t, u in self.samples if t0 <= t <= t1]

    def close(self):
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=10)


def _label(label: str) -> tuple[str, bool, str, bool]:
    """``mode[+margin][+nocodes][:read_next]`` (``--modes``) -> (mode, on the margin store, read_next or "",
    whether the trainer compares codes: False with ``+nocodes``, `TrainConfig.code_agreement` off)."""
    head, _, read_next = label.partition(":")
    mode, *extras = head.split("+")
    if any(e not in ("margin", "nocodes") for e in extras) or len(set(extras)) != len(extras):
        raise ValueError(f"--modes {label}: the parts after '+' can only be 'margin' and 'nocodes', each once")
    return mode, "margin" in extras, read_next, "nocodes" not in extras


def _run(label: str, url: str, workdir: Path, args, sampler: _GpuSampler, *, profile_step: int = 0,
         phases: bool = False) -> dict:
    """One training process of ``label`` (``mode[+margin][:read_next]``, see ``--modes``) on the store ``url``."""
    mode, _, read_next, codes = _label(label)
    read_next = read_next or args.read_next
    metrics = workdir / f"{label.replace(':', '-').replace('+', '-')}-{read_next}-{time.time_ns()}.jsonl"
    argv = [sys.executable, os.path.abspath(__file__), "--child", "--store", url, "--mode", mode, "--metrics",
            str(metrics), "--steps", str(args.steps), "--groups", str(args.groups), "--group-size",
            str(args.group_size), "--device", args.device, "--threads", str(args.threads),
            "--max-staleness", str(args.max_staleness), "--unmeasured-from", str(args.unmeasured_from),
            "--profile-step", str(profile_step), "--read-next", read_next,
            "--margin-decode", args.margin_decode] + (["--time-phases"] if phases else []) + (
            [] if codes else ["--no-code-agreement"])
    if args.micro_batch_tokens:
        argv += ["--micro-batch-tokens", str(args.micro_batch_tokens)]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout)
    if p.returncode != 0:
        raise SystemExit(f"{mode}: training failed:\n{p.stderr[-3000:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    cut = args.unmeasured_from - 1 if 0 < args.unmeasured_from <= args.steps else len(rows)
    measured, unmeasured = rows[1:cut] or rows[:1], rows[cut:]
    # steps 2..: from the end of step 1 to the end of the last step
    util = sampler.between(rows[0]["time_unix"], rows[-1]["time_unix"]) if len(rows) > 1 else []
    return {"rows": rows, "step_s": statistics.median(r["step_s"] for r in measured),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in measured),
            "step_s_unmeasured": statistics.median(r["step_s"] for r in unmeasured) if unmeasured else None,
            "cut": cut,  # rows[1:cut] measured the stale groups, rows[cut:] did not
            "gpu_util_median": statistics.median(util) if util else None, "gpu_util_samples": len(util),
            "metrics": str(metrics)}


def _spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def _measured_rows(reps: list[dict]) -> tuple[list[dict], list[dict]]:
    """The steps of ``reps`` with the stale forward (2 .. cut-1) and without (cut ..)."""
    return ([r for rep in reps for r in rep["rows"][1:rep["cut"]] or rep["rows"][:1]],
            [r for rep in reps for r in rep["rows"][rep["cut"]:]])


def _phases(reps: list[dict]) -> dict:
    """Phase medians (and step times) of the ``time_phases`` runs ``reps``."""
    later, rest = _measured_rows(reps)
    names = dict.fromkeys(k for r in later + rest for k in (r.get("phases_s") or {}))
    return {"runs": len(reps),
            "phases_s_median": {k: statistics.median(r["phases_s"].get(k, 0.0) for r in later) for k in names},
            "phases_s_median_unmeasured": ({k: statistics.median(r["phases_s"].get(k, 0.0) for r in rest)
                                            for k in names} if rest else None),
            "step_s": _spread([rep["step_s"] for rep in reps]),
            "step_s_unmeasured": (_spread([rep["step_s_unmeasured"] for rep in reps])
                                  if all(rep["step_s_unmeasured"] is not None for rep in reps) else None)}


def _cycle(rep: dict, n: int) -> tuple[float, float] | None:
    """(the step that keeps its version's weights, the mean step over a cycle of ``n`` versions) of one run: with the
    rollout one version ahead, of every n steps one runs the stale forward (``step_s``), one copies its version's
    weights to pinned host memory for later stale forwards (``version - 1`` a multiple of n: the copy runs beside the
    step's compute) and n - 2 do neither (the median of the unmeasured steps that keep nothing). "default mean"
    counts the copying step as a plain one; this counts it as it ran. None without such a step (or another)."""
    rest = rep["rows"][rep["cut"]:]
    snap = [r["step_s"] for r in rest if (r["version"] - 1) % n == 0]
    plain = [r["step_s"] for r in rest if (r["version"] - 1) % n]
    if not snap or not plain:
        return None
    s = statistics.median(snap)
    return s, (rep["step_s"] + s + (n - 2) * statistics.median(plain)) / n


def _summary(runs: dict[str, list[dict]], phase_runs: dict[str, list[dict]] | None = None) -> dict:
    out = {}
    for mode, reps in runs.items():
        if not reps:
            continue
        later, _ = _measured_rows(reps)
        utils = [rep["gpu_util_median"] for rep in reps if rep["gpu_util_median"] is not None]
        peak = [r["cuda_max_allocated_bytes"] for rep in reps for r in rep["rows"] if r.get("cuda_max_allocated_bytes")]
        out[mode] = {
            "step_s": _spread([rep["step_s"] for rep in reps]),  # the steps with the stale forward
            "tokens_per_s": _spread([rep["tokens_per_s"] for rep in reps]),
            "gpu_util_median": _spread(utils) if utils else None,
            "with_phase_clock": _phases(phase_runs[mode]) if phase_runs and phase_runs.get(mode) else None,
            "tokens_per_step": statistics.median(r["tokens"] for r in later),
            "cuda_max_allocated_gib": max(peak) / 2**30 if peak else None,
            "code_agreement": [r["mismatch"]["code_agreement"] for r in reps[0]["rows"]],
            "digests": [r["digest"] for r in reps[0]["rows"]],
            "digests_same_every_run": all([r["digest"] for r in rep["rows"]] == [r["digest"] for r in reps[0]["rows"]]
                                          for rep in reps),
        }
        if all(rep["step_s_unmeasured"] is not None for rep in reps):
            n = TRAIN_DEFAULTS.measure_stale_every
            mean = [(rep["step_s"] + (n - 1) * rep["step_s_unmeasured"]) / n for rep in reps]
            out[mode]["step_s_unmeasured"] = _spread([rep["step_s_unmeasured"] for rep in reps])
            out[mode]["step_s_default_mean"] = _spread(mean)  # per run, then median and spread over runs
            out[mode]["tokens_per_s_default_mean"] = _spread([out[mode]["tokens_per_step"] / m for m in mean])
            out[mode]["measure_stale_every"] = n
            cycle = [_cycle(rep, n) for rep in reps]
            if n >= 2 and all(c is not None for c in cycle):
                out[mode]["step_s_snapshot"] = _spread([c[0] for c in cycle])
                out[mode]["step_s_cycle_mean"] = _spread([c[1] for c in cycle])
                out[mode]["tokens_per_s_cycle_mean"] = _spread([out[mode]["tokens_per_step"] / c[1] for c in cycle])
    for label in list(out):  # X+margin over X (the same mode and read_next on the plain store)
        mode, margin, rn, codes = _label(label)
        other = mode + ("" if codes else "+nocodes") + (":" + rn if rn else "")
        if not margin or other not in out:
            continue
        tag = f"{mode}{'' if codes else '_nocodes'}_margin_over_plain" + (f"_read_next_{rn}" if rn else "")
        for key in ("step_s", "step_s_unmeasured", "step_s_default_mean", "step_s_cycle_mean"):
            if key in out[label] and key in out[other]:
                out[f"{tag}_{key}"] = out[label][key]["median"] / out[other][key]["median"]
    for label in list(out):  # X+nocodes over X: what comparing the rollout's codes costs
        if "_over_" in label:
            continue
        mode, margin, rn, codes = _label(label)
        other = label.replace("+nocodes", "")
        if codes or other not in out:
            continue
        tag = f"{mode}{'_margin' if margin else ''}_nocodes_over_codes" + (f"_read_next_{rn}" if rn else "")
        for key in ("step_s", "step_s_unmeasured", "step_s_default_mean", "step_s_cycle_mean"):
            if key in out[label] and key in out[other]:
                out[f"{tag}_{key}"] = out[label][key]["median"] / out[other][key]["median"]
    for label in list(out):  # fp4_hints over bf16 with the same read_next (fp4_hints:process / bf16:process)
        if "_over_" in label or "+margin" in label:
            continue
        head, sep, rn = label.partition(":")
        other = "bf16" + sep + rn
        if head not in ("fp4_hints", "fp4_hints+nocodes") or other not in out:
            continue
        tag = head.replace("+", "_") + "_over_bf16" + (f"_read_next_{rn}" if sep else "")
        for key in ("step_s", "step_s_unmeasured", "step_s_default_mean", "step_s_cycle_mean"):
            if key in out[label] and key in out[other]:
                out[f"{tag}_{key}"] = out[label][key]["median"] / out[other][key]["median"]
        out[f"{tag}_step"] = out[f"{tag}_step_s"]
    return out


def _machine(device: str) -> dict:
    import platform

    import torch
    import transformers

    return {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "cuda_device": torch.cuda.get_device_name(0) if device.startswith("cuda") else None,
            "cuda_total_gib": (torch.cuda.get_device_properties(0).total_memory / 2**30
                               if device.startswith("cuda") else None),
            "loadavg_1_5_15": list(os.getloadavg())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default=",".join(MODES), metavar="LIST",
                    help="comma-separated trainer modes (default: fp4_hints,bf16); a mode may name its own "
                         "--read-next after a colon, to time several side by side on one store: "
                         "fp4_hints,bf16,fp4_hints:process,bf16:process; 'MODE+margin' trains on a second store whose "
                         "hinted sites are margin rows (--margin's point, default 0.05:0.05:lsb), side by side with "
                         "MODE on the plain one: fp4_hints,fp4_hints+margin; 'MODE+nocodes' trains without comparing "
                         "the rollout's recorded codes (TrainConfig.code_agreement off, as on a store recorded "
                         "without codes: a rollout's default): fp4_hints,fp4_hints+nocodes,bf16")
    ap.add_argument("--runs", type=int, default=3, metavar="N", help="processes per mode (default 3)")
    ap.add_argument("--steps", type=int, default=8, metavar="N",
                    help="steps per run (default 8; step 1 warms up, steps 2.. are measured)")
    ap.add_argument("--max-staleness", type=int, default=7, metavar="N",
                    help="the trainer's max_staleness (default 7, so that step 8 still trains the version-0 groups); "
                         "must be >= steps - 1")
    ap.add_argument("--unmeasured-from", type=int, default=3, metavar="K",
                    help="steps K.. run without the stale groups' measurement (default 3; 0: every step measures)")
    ap.add_argument("--device", default="cpu", metavar="DEVICE", help="cpu (default) or cuda (one GPU: the H200 model)")
    ap.add_argument("--groups", type=int, default=4, metavar="N", help="groups per step (default 4)")
    ap.add_argument("--group-size", type=int, default=8, metavar="N", help="trajectories per group (default 8)")
    ap.add_argument("--response-len", type=int, default=None, metavar="N",
                    help="response tokens per trajectory (default: 128 on CUDA, 8 on the CPU)")
    ap.add_argument("--micro-batch-tokens", type=int, default=None, metavar="N",
                    help="override the trainer's micro-batch size (default: the trainer's own default)")
    ap.add_argument("--layers", type=int, default=None, metavar="N",
                    help="decoder layers of the model (default: the H200 model's 40 on CUDA; 20 fit an 80 GB H100 with "
                         "the trainer's fp32 masters and AdamW state, which 40 do not)")
    ap.add_argument("--hint-layers", default="latter-half", metavar="WHICH",
                    help="hinted layers of the store (default latter-half: 20 of 40 sites on the H200 model)")
    ap.add_argument("--margin", type=_margin_arg, default=None, metavar="M:MS[:lsb]",
                    help="record the store's hinted sites as margin-exception rows at value margin M and scale margin "
                         "MS (ladder / E4M3 steps; ':lsb' keeps scale LSBs), so the steps include the margin decode "
                         "and fill-in (default: hint bits and scale bytes)")
    ap.add_argument("--margin-coding", default="gamma:bitmap", metavar="V:B",
                    help="value and block position codings of --margin's sites (default gamma:bitmap)")
    ap.add_argument("--margin-decode", choices=MARGIN_DECODES, default=TRAIN_DEFAULTS.margin_decode,
                    help="where the trainer decodes margin rows (TrainConfig.margin_decode: auto is the Triton decoder "
                         f"on a GPU; default {TRAIN_DEFAULTS.margin_decode})")
    ap.add_argument("--read-next", choices=("auto", "off", "thread", "process"), default="auto",
                    help="read the next step's data while a step computes: auto (run_training's default: a reader "
                         "process on a GPU, off on the CPU), off, in a thread, or in a reader process")
    ap.add_argument("--threads", type=int, default=1, metavar="N", help="torch CPU threads per process (default 1)")
    ap.add_argument("--phase-runs", type=int, default=1, metavar="N",
                    help="more processes per mode with the trainer's phase clock (time_phases: a device sync at each "
                         "phase), for where the time goes; not timed with the others (default 1; 0: none)")
    ap.add_argument("--profile", action="store_true",
                    help="also profile one more run per mode: step --profile-at under torch.profiler and the next step "
                         "(if within --steps) under cProfile (host time per Python function)")
    ap.add_argument("--profile-at", type=int, default=2, metavar="K",
                    help="the step --profile traces with torch.profiler (default 2: a step with the stale forward; "
                         "a step at or after --unmeasured-from traces one without it, e.g. --steps 8 "
                         "--max-staleness 7 --profile-at 4)")
    ap.add_argument("--timeout", type=float, default=1800, metavar="S", help="seconds per process (default 1800)")
    ap.add_argument("--store-dir", default=None, metavar="DIR",
                    help="keep the recorded store(s) under DIR and reuse them in a later invocation with the same "
                         "model, rollout shape, device type, hinted layers and margin (recording the H200 model's "
                         "store takes ~100 s on an H100; the recording code is not compared: use a fresh DIR after "
                         "changing it; default: record into a temporary folder every time)")
    ap.add_argument("--smoke", action="store_true", help="tiny model, 1 run x 2 steps: checks the code paths")
    ap.add_argument("--out", default=None, metavar="PATH",
                    help="JSON (default benchmarks/results/trainer-<device>.json; --smoke: a temporary file)")
    # the child process's options (internal)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--no-code-agreement", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--metrics", help=argparse.SUPPRESS)
    ap.add_argument("--profile-step", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--time-phases", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--resummarize", default=None, metavar="SAVED",
                    help="recompute the summary of a saved result (its recorded runs, no new run) with this version "
                         "of the program, print it and write it to --out (default: SAVED-resummarized.json)")
    args = ap.parse_args(argv)
    if args.child:
        return _child(args)
    if args.resummarize:
        return _resummarize(args.resummarize, args.out)
    if args.max_staleness < args.steps - 1:
        ap.error(f"--max-staleness {args.max_staleness} with --steps {args.steps}: every group is by version 0, "
                 f"so steps after {args.max_staleness + 1} would find none; use --max-staleness >= {args.steps - 1}")
    if args.profile and not 1 <= args.profile_at <= args.steps:
        ap.error(f"--profile-at {args.profile_at} must be a step of the run, 1..{args.steps}")
    cuda = args.device.startswith("cuda")
    spec = SMOKE_SPEC if args.smoke else (GPU_SPEC if cuda else CPU_SPEC)
    if args.layers is not None:
        if args.layers < 1:
            ap.error(f"--layers {args.layers}: needs at least 1")
        spec = {**spec, "num_layers": args.layers}
    if args.response_len is None:
        args.response_len = 128 if cuda and not args.smoke else 8
    if args.smoke:
        args.runs, args.groups, args.group_size = 1, 2, 4
    out = Path(args.out or (tempfile.mkdtemp(prefix="trainer-smoke-") + "/trainer.json" if args.smoke else
                            f"{_REPO}/benchmarks/results/trainer-{'h200' if cuda else 'cpu'}.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        try:
            mode, _, rn, _ = _label(m)
        except ValueError as e:
            ap.error(str(e))
        if rn not in ("", "auto", "off", "thread", "process"):
            ap.error(f"--modes {m}: the part after ':' is a --read-next choice (auto, off, thread, process)")
    side_by_side = any(_label(m)[1] for m in modes)  # X+margin: a second store, the hinted sites as margin rows
    workdir = Path(tempfile.mkdtemp(prefix="tracerl-bench-trainer-"))
    margin_point = args.margin or (DEFAULT_MARGIN if side_by_side else None)
    t0 = time.perf_counter()
    urls, reused = _stores(args, spec, side_by_side, margin_point, workdir)
    if side_by_side:
        args.margin = margin_point
    print(f"store{'s' if side_by_side else ''} {'reused from ' + str(Path(urls[False]).parent) if reused else 'recorded'}"
          f" in {time.perf_counter() - t0:.1f}s: {args.steps} batches of {args.groups} x {args.group_size}", flush=True)
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    sampler = _GpuSampler(enabled=cuda)
    result = {"machine": _machine(args.device), "spec": spec, "device": args.device, "args": vars(args),
              "store_reused": reused}
    try:
        for i in range(args.runs):
            for mode in modes:  # alternating, so a drift of the machine hits every mode alike
                r = _run(mode, urls[_label(mode)[1]], workdir, args, sampler)
                runs[mode].append(r)
                print(f"run {i + 1}/{args.runs} {mode}: step_s {[round(x['step_s'], 3) for x in r['rows']]} "
                      f"gpu util {r['gpu_util_median']}", flush=True)
                result.update(runs=runs, summary=_summary(runs))
                out.write_text(json.dumps(result, indent=1))
        phase_runs: dict[str, list[dict]] = {m: [] for m in modes}
        for i in range(args.phase_runs):
            for mode in modes:
                r = _run(mode, urls[_label(mode)[1]], workdir, args, sampler, phases=True)
                phase_runs[mode].append(r)
                print(f"phase run {i + 1}/{args.phase_runs} {mode}: step_s {[round(x['step_s'], 3) for x in r['rows']]}",
                      flush=True)
        result.update(phase_runs=phase_runs, summary=_summary(runs, phase_runs))
        if args.profile:
            for mode in modes:  # fp4_hints keeps the "-profile" file names of earlier runs
                r = _run(mode, urls[_label(mode)[1]], workdir, args, sampler, profile_step=args.profile_at)
                base = r["metrics"].removesuffix(".jsonl")
                tag = "" if mode == "fp4_hints" else "-" + mode.replace("+", "-").replace(":", "-")
                dest = str(out).removesuffix(".json") + "-profile" + tag
                for suffix in ("-trace.json.gz", "-top.txt", "-python.txt"):
                    if os.path.exists(base + suffix):
                        shutil.copy(base + suffix, dest + suffix)
                key = "profile" if mode == "fp4_hints" else f"profile_{mode}"
                result[key] = {"rows": r["rows"], "step": args.profile_at, "trace": dest + "-trace.json.gz"}
    finally:
        sampler.close()
    out.write_text(json.dumps(result, indent=1))
    _report(result["summary"], modes)
    print(f"saved {out}")
    return 0


def _store_settings(args, spec: dict, side_by_side: bool, margin_point) -> dict:
    """Everything that decides the bytes of the recorded store(s): the model, the rollout's shape and device type,
    the hinted layers, the margin point and coding."""
    return {"spec": spec, "device": args.device.split(":")[0], "steps": args.steps, "groups": args.groups,
            "group_size": args.group_size, "response_len": args.response_len, "hint_layers": args.hint_layers,
            "margin": list(margin_point) if margin_point else None, "side_by_side": side_by_side,
            "margin_coding": args.margin_coding}


def _stores(args, spec: dict, side_by_side: bool, margin_point, workdir: Path) -> tuple[dict[bool, str], bool]:
    """The store URLs by "on the margin store" (one store unless ``side_by_side``), recorded now, or with
    ``--store-dir`` taken from an earlier invocation's recording with the same settings (`_store_settings`; a
    folder named by their hash holds the stores and ``settings.json``, written last: a folder without it is an
    interrupted recording, recorded again, and so is one whose settings.json does not read back). The code that
    recorded a kept store is not compared: after changing how stores are recorded, use a fresh DIR. Returns
    (urls, reused)."""
    import hashlib

    base, reused = workdir, False
    if args.store_dir:
        text = json.dumps(_store_settings(args, spec, side_by_side, margin_point), sort_keys=True)
        base = Path(args.store_dir) / hashlib.sha256(text.encode()).hexdigest()[:16]
        try:
            reused = (base / "settings.json").read_text() == text
        except (FileNotFoundError, NotADirectoryError):
            reused = False
        if not reused and base.exists():
            shutil.rmtree(base)
        base.mkdir(parents=True, exist_ok=True)
    urls = {False: str(base / "store")}
    urls[True] = str(base / "store-margin") if side_by_side else urls[False]  # (one store, margin rows if --margin)
    if not reused:
        record_store(urls[False], spec, argparse.Namespace(**{**vars(args), "margin": None if side_by_side else
                                                               args.margin}))
        if side_by_side:
            record_store(urls[True], spec, argparse.Namespace(**{**vars(args), "margin": margin_point}))
        if args.store_dir:
            (base / "settings.json").write_text(text)
    return urls, reused


def _resummarize(src: str, out: str | None) -> int:
    """The summary of a saved result recomputed by this version of `_summary` (its runs as they were recorded),
    written to ``out`` (default: SRC with ``-resummarized`` before ``.json``), and its table printed."""
    try:
        result = json.loads(Path(src).read_text())
        runs, phase_runs = result["runs"], result.get("phase_runs")
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"--resummarize {src}: not a saved benchmark_trainer result ({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    result["summary"] = _summary(runs, phase_runs)
    result["resummarized_from"] = str(src)
    dest = Path(out or str(src).removesuffix(".json") + "-resummarized.json")
    dest.write_text(json.dumps(result, indent=1))
    _report(result["summary"], [m for m in runs if runs[m]])
    print(f"saved {dest}")
    return 0


def _report(s: dict, modes: list[str]) -> None:
    """Print the summary ``s`` (`_summary`) as the table and lines a run ends with."""
    print(f"{'mode':18} {'step s (min..max)':>24} {'tok/s (min..max)':>22} {'GPU util %':>11} {'peak GiB':>9}  code agr.")
    for mode in modes:
        m = s[mode]
        u = m["gpu_util_median"]
        print(f"{mode:18} {m['step_s']['median']:9.3f} ({m['step_s']['min']:.3f}..{m['step_s']['max']:.3f})"
              f" {m['tokens_per_s']['median']:8.0f} ({m['tokens_per_s']['min']:.0f}..{m['tokens_per_s']['max']:.0f})"
              f" {'-' if u is None else format(u['median'], '.0f'):>11}"
              f" {'-' if m['cuda_max_allocated_gib'] is None else format(m['cuda_max_allocated_gib'], '.1f'):>9}"
              f"  {m['code_agreement'][-1]}")
    for key in s:
        if key.startswith(("fp4_hints_over_bf16", "fp4_hints_nocodes_over_bf16")) and key.endswith("_step"):
            print(f"{key.removesuffix('_step').replace('_', ' ')}: step time {s[key]:.3f}")
    for mode in modes:
        ph = s[mode]["with_phase_clock"]
        if not ph:
            continue
        print(f"phases {mode} ({ph['runs']} run(s) with the phase clock, step {ph['step_s']['median']:.3f} s): "
              + ", ".join(f"{k} {v:.3f}" for k, v in ph["phases_s_median"].items()))
        if ph["phases_s_median_unmeasured"]:
            print(f"phases {mode} (no stale forward, step {ph['step_s_unmeasured']['median']:.3f} s): "
                  + ", ".join(f"{k} {v:.3f}" for k, v in ph["phases_s_median_unmeasured"].items()))
    for mode in modes:
        if "step_s_default_mean" in s[mode]:
            m = s[mode]
            print(f"{mode}: step with the stale forward {m['step_s']['median']:.3f} s, without "
                  f"{m['step_s_unmeasured']['median']:.3f} s ({m['step_s_unmeasured']['min']:.3f}.."
                  f"{m['step_s_unmeasured']['max']:.3f}); mean at measure_stale_every={m['measure_stale_every']}: "
                  f"{m['step_s_default_mean']['median']:.3f} s = {m['tokens_per_s_default_mean']['median']:.0f} tok/s")
    for mode in modes:
        if "step_s_cycle_mean" in s[mode]:
            m = s[mode]
            print(f"{mode}: the step that keeps its version's weights {m['step_s_snapshot']['median']:.3f} s; mean "
                  f"over a cycle of {m['measure_stale_every']} (one stale forward, one keeping, the rest neither): "
                  f"{m['step_s_cycle_mean']['median']:.3f} s = {m['tokens_per_s_cycle_mean']['median']:.0f} tok/s")
    for key in s:
        if "_over_" in key and key.endswith("_step_s_cycle_mean"):
            print(f"{key.removesuffix('_step_s_cycle_mean').replace('_', ' ')} over the cycle: {s[key]:.3f}")
    for key in s:
        if "_over_" in key and key.endswith("_step_s_default_mean"):
            print(f"{key.removesuffix('_step_s_default_mean').replace('_', ' ')} at the default mean: {s[key]:.3f}"
                  + (f" (without the stale forward {s[key.replace('default_mean', 'unmeasured')]:.3f})"
                     if key.replace("default_mean", "unmeasured") in s else ""))


if __name__ == "__main__":
    sys.exit(main())
