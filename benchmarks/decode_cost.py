"""What the trainer's decode of hints costs per step, from two measured files (issue 23: "<= 1% of a step").

The trainer decodes what the store holds inside the fake-quant kernel it runs at every hinted site anyway: with
today's layout (``bytes``) the hint bits select the neighbouring code (`tracefp4.fake_quantize`), with scale hints
(``lsb``) the kernel also rebuilds each block's E4M3 byte from its own amax and the stored LSB
(`tracefp4.fake_quantize_lsb`). The decode's cost is therefore the kernel's time over round-to-nearest with the
same scales (`fake_quant_rtn`), per value, from `benchmark_kernels.py`'s JSON (bf16 NVFP4, the default
configuration per case, median of its runs), times the hinted values one trainer step quantizes, over the step
time of `benchmark_trainer.py`'s JSON (``fp4_hints``, the mean step at the default ``measure_stale_every``, median
over runs). A step quantizes each hinted site once per forward: the training forward and, on the steps that measure
staleness, the stale forward (1 / ``measure_stale_every`` of the steps).

This is a derived figure (a product of measured medians), not a timing of its own: the step's spread (about 15%)
is far larger than the decode, so timing the trainer on a bytes store against an lsb store would measure noise.

    python benchmarks/decode_cost.py                                   # the committed H200 files
    python benchmarks/decode_cost.py --kernels K.json --trainer T.json --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

_RESULTS = Path(__file__).resolve().parent / "results"


def _site_count(spec: dict, hint_layers: str) -> int:
    """Hinted MoE-input sites of the trainer benchmark's coverage (its ``--hint-layers``)."""
    n = int(spec["num_layers"])
    if hint_layers == "latter-half":
        return n - n // 2
    if hint_layers == "all":
        return n
    raise ValueError(f"hint_layers {hint_layers!r} not understood (latter-half or all)")


def derive(kernels: dict, trainer: dict, *, dtype: str = "bf16", fmt: str = "nvfp4") -> dict:
    """The decode's cost per step (see the module docstring) for the kernel case of the trainer's hidden size.

    Raises ValueError when the kernels file has no case of the trainer's width (or the coverage is unknown) and
    KeyError when a file lacks a field."""
    spec, summary = trainer["spec"], trainer["summary"]["fp4_hints"]
    width = int(spec["hidden_size"])
    cases = [r for r in kernels["results"] if r["hidden"] == width and r["dtype"] == dtype and r["fmt"] == fmt]
    if not cases:
        have = sorted({(r["hidden"], r["dtype"], r["fmt"]) for r in kernels["results"]})
        raise ValueError(f"no kernel case hidden={width} {dtype} {fmt} in the kernels file; it has {have}")
    case = cases[0]
    values_per_call = case["rows"] * case["hidden"]
    ms = {k: case["default"][k]["ms_median"] for k in ("fake_quant_rtn", "fake_quant", "fake_quant_lsb")}
    every = int(summary.get("measure_stale_every", 4))
    sites = _site_count(spec, trainer["args"]["hint_layers"])
    values_per_step = summary["tokens_per_step"] * sites * width * (1 + 1 / every)
    step_s = summary["step_s_default_mean"]["median"]
    out = {"benchmark": "decode_cost", "kernel_case": {"hidden": width, "rows": case["rows"], "dtype": dtype,
                                                       "fmt": fmt, "ms_median": ms,
                                                       "configs": {k: case["default"][k]["config"] for k in ms}},
           "step": {"tokens": summary["tokens_per_step"], "hinted_sites": sites, "width": width,
                    "measure_stale_every": every, "hinted_values": values_per_step, "step_s_default_mean": step_s},
           "machine": {"kernels": kernels.get("gpu"), "trainer": trainer.get("machine")}, "encodings": {}}
    for enc, kernel in (("bytes", "fake_quant"), ("lsb", "fake_quant_lsb")):
        decode_s = (ms[kernel] - ms["fake_quant_rtn"]) / 1e3 / values_per_call * values_per_step
        whole_s = ms[kernel] / 1e3 / values_per_call * values_per_step
        out["encodings"][enc] = {"decode_s_per_step": decode_s, "decode_pct_of_step": 100 * decode_s / step_s,
                                 "fake_quant_s_per_step": whole_s, "fake_quant_pct_of_step": 100 * whole_s / step_s}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", type=Path, default=_RESULTS / "kernels-h200-lsb.json",
                    help="benchmark_kernels.py JSON with fake_quant_lsb timed (default: %(default)s)")
    ap.add_argument("--trainer", type=Path, default=_RESULTS / "trainer-h200-after-launch-cuts.json",
                    help="benchmark_trainer.py JSON (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=_RESULTS / "decode-cost-h200.json", help="JSON path (default: %(default)s)")
    args = ap.parse_args(argv)
    try:
        kernels, trainer = json.loads(args.kernels.read_text()), json.loads(args.trainer.read_text())
    except (OSError, ValueError) as e:
        print(f"decode_cost: cannot read the input files: {e}", file=sys.stderr)
        return 2
    try:
        res = derive(kernels, trainer)
    except (KeyError, ValueError) as e:
        print(f"decode_cost: the input files do not hold what it needs: {e}", file=sys.stderr)
        return 2
    st = res["step"]
    print(f"trainer step: {st['tokens']} tokens x {st['hinted_sites']} hinted sites x {st['width']} "
          f"(x {1 + 1 / st['measure_stale_every']:.2f} forwards) = {st['hinted_values'] / 1e6:.0f}M values; "
          f"mean step {st['step_s_default_mean']:.3f} s")
    print(f"{'encoding':<9} {'decode ms/step':>15} {'% of step':>10} {'fake quant ms/step':>19} {'% of step':>10}")
    for enc, r in res["encodings"].items():
        print(f"{enc:<9} {1e3 * r['decode_s_per_step']:>15.3f} {r['decode_pct_of_step']:>10.4f} "
              f"{1e3 * r['fake_quant_s_per_step']:>19.3f} {r['fake_quant_pct_of_step']:>10.4f}")
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
