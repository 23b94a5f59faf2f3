"""benchmarks/decode_cost.py: the per-step decode figure follows from the two files it reads."""

from __future__ import annotations

import json

import pytest
from helpers import benchmarks


def _module():
    return benchmarks.load("decode_cost")


def _inputs(hidden: int = 64) -> tuple[dict, dict]:
    case = {"hidden": hidden, "rows": 1000, "dtype": "bf16", "fmt": "nvfp4",
            "default": {"fake_quant_rtn": {"ms_median": 1.0, "config": "a"},
                        "fake_quant": {"ms_median": 1.1, "config": "b"},
                        "fake_quant_lsb": {"ms_median": 1.3, "config": "c"}}}
    kernels = {"gpu": "test", "results": [case]}
    trainer = {"device": "cpu", "spec": {"hidden_size": 64, "num_layers": 4}, "args": {"hint_layers": "latter-half"},
               "summary": {"fp4_hints": {"tokens_per_step": 500, "measure_stale_every": 4,
                                         "step_s_default_mean": {"median": 2.0}}}}
    return kernels, trainer


def test_decode_cost_is_kernel_time_over_rtn_times_values_over_step():
    res = _module().derive(*_inputs())
    values = 500 * 2 * 64 * 1.25  # tokens x latter-half sites (2 of 4) x width x (1 + 1/4) forwards
    assert res["step"]["hinted_values"] == values
    per_value_lsb = (1.3 - 1.0) / 1e3 / (1000 * 64)
    assert res["encodings"]["lsb"]["decode_s_per_step"] == pytest.approx(per_value_lsb * values)
    assert res["encodings"]["lsb"]["decode_pct_of_step"] == pytest.approx(100 * per_value_lsb * values / 2.0)
    assert res["encodings"]["bytes"]["decode_s_per_step"] == pytest.approx((0.1 / 1e3 / 64000) * values)


def test_decode_cost_without_the_trainer_width_says_what_the_file_has(tmp_path):
    kernels, trainer = _inputs(hidden=128)
    (tmp_path / "k.json").write_text(json.dumps(kernels))
    (tmp_path / "t.json").write_text(json.dumps(trainer))
    with pytest.raises(ValueError, match=r"no kernel case hidden=64.*\(128, 'bf16', 'nvfp4'\)"):
        _module().derive(kernels, trainer)
    assert _module().main(["--kernels", str(tmp_path / "k.json"), "--trainer", str(tmp_path / "t.json"),
                           "--out", str(tmp_path / "o.json")]) == 2
    assert not (tmp_path / "o.json").exists()


def test_decode_cost_unreadable_input_exits_2(tmp_path):
    assert _module().main(["--kernels", str(tmp_path / "missing.json"), "--out", str(tmp_path / "o.json")]) == 2
