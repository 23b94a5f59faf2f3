"""benchmarks/benchmark_trainer.py's summary: the mean step over a cycle of the default configuration counts the step
that keeps its version's weights as it ran (the "default mean" counted it as a plain step), and ``--resummarize``
recomputes a saved result's summary without a new run."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from helpers import benchmarks


def _rep(steps: list[float], cut: int = 2) -> dict:
    """A run's record: row i is the step that made version i + 1; rows[1:cut] ran the stale forward."""
    rows = [{"step": i + 1, "version": i + 1, "step_s": s, "tokens": 100, "tokens_per_s": 100 / s,
             "mismatch": {"code_agreement": None}, "digest": "d"} for i, s in enumerate(steps)]
    unmeasured = [r["step_s"] for r in rows[cut:]]
    return {"rows": rows, "cut": cut, "step_s": steps[1], "tokens_per_s": 100 / steps[1],
            "step_s_unmeasured": sorted(unmeasured)[len(unmeasured) // 2], "gpu_util_median": None}


def test_the_cycle_mean_counts_the_step_that_keeps_weights():
    bt = benchmarks.load("benchmark_trainer")
    n = bt.TRAIN_DEFAULTS.measure_stale_every
    assert n == 4  # the figures below assume the default
    # steps 1..8 make versions 1..8; step 5 (version 4 before it) keeps its weights: 0.30 s, the others 0.20
    rep = _rep([2.0, 0.40, 0.20, 0.20, 0.30, 0.20, 0.20, 0.20])
    snap, mean = bt._cycle(rep, n)
    assert snap == pytest.approx(0.30) and mean == pytest.approx((0.40 + 0.30 + 2 * 0.20) / 4)
    s = bt._summary({"fp4_hints": [rep, rep, rep], "bf16": [_rep([1.0, 0.3, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2])] * 3})
    assert s["fp4_hints"]["step_s_default_mean"]["median"] == pytest.approx((0.40 + 3 * 0.20) / 4)
    assert s["fp4_hints"]["step_s_cycle_mean"]["median"] == pytest.approx(0.275)
    assert s["fp4_hints_over_bf16_step_s_cycle_mean"] == pytest.approx(0.275 / ((0.3 + 0.2 + 2 * 0.2) / 4))
    assert bt._cycle(_rep([2.0, 0.4, 0.2]), n) is None  # no keeping step in the run: no cycle figure


def test_resummarize_recomputes_a_saved_result(tmp_path, capsys):
    bt = benchmarks.load("benchmark_trainer")
    saved = tmp_path / "t.json"
    saved.write_text(json.dumps({"runs": {"fp4_hints": [_rep([2.0, 0.4, 0.2, 0.2, 0.3, 0.2, 0.2, 0.2])]},
                                 "summary": {"old": 1}}))
    assert bt.main(["--resummarize", str(saved)]) == 0
    got = json.loads((tmp_path / "t-resummarized.json").read_text())
    assert "old" not in got["summary"] and got["summary"]["fp4_hints"]["step_s_cycle_mean"]["median"] == pytest.approx(0.275)
    assert "over a cycle of 4" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text("{}")
    assert bt.main(["--resummarize", str(tmp_path / "bad.json")]) == 2


def test_store_dir_reuses_a_recording_with_the_same_settings_only(tmp_path, monkeypatch):
    """``--store-dir``: the first invocation records into a folder named by the recording's settings, a second with
    the same settings reuses it without recording, other settings (a margin point, the model) record beside it, and
    a folder whose recording was interrupted (no settings.json) is recorded again from scratch."""
    bt = benchmarks.load("benchmark_trainer")
    recorded = []

    def record(url, spec, args):  # stands in for the spawned rollout: a folder per store
        recorded.append((url, args.margin))
        Path(url).mkdir(parents=True)

    monkeypatch.setattr(bt, "record_store", record)
    args = argparse.Namespace(store_dir=str(tmp_path / "stores"), device="cuda:0", steps=8, groups=4, group_size=8,
                              response_len=128, hint_layers="latter-half", margin=None, margin_coding="gamma:bitmap")
    spec = {"num_layers": 20}
    point = (0.05, 0.05, "lsb")
    urls, reused = bt._stores(args, spec, True, point, tmp_path / "work")
    assert not reused and [m for _, m in recorded] == [None, point]
    assert urls[True] != urls[False] and (tmp_path / "stores") in Path(urls[False]).parents
    again, reused = bt._stores(argparse.Namespace(**{**vars(args), "device": "cuda"}), spec, True, point,
                               tmp_path / "work2")
    assert reused and again == urls and len(recorded) == 2  # the same recording, nothing recorded
    other, reused = bt._stores(args, spec, True, (0.1, 0.1, "lsb"), tmp_path / "work")
    assert not reused and other[False] != urls[False] and len(recorded) == 4
    _, reused = bt._stores(args, {"num_layers": 40}, True, point, tmp_path / "work")
    assert not reused and len(recorded) == 6
    (Path(urls[False]).parent / "settings.json").unlink()  # as if killed while recording
    again, reused = bt._stores(args, spec, True, point, tmp_path / "work")
    assert not reused and again == urls and len(recorded) == 8  # the partial folder was removed, then recorded
    (Path(urls[False]).parent / "settings.json").write_text("{not json")  # damaged: recorded again, not trusted
    again, reused = bt._stores(args, spec, True, point, tmp_path / "work")
    assert not reused and again == urls and len(recorded) == 10
    one, reused = bt._stores(argparse.Namespace(**{**vars(args), "store_dir": None}), spec, False, None,
                             tmp_path / "tmpwork")
    assert not reused and one[True] == one[False] and one[False].startswith(str(tmp_path / "tmpwork"))


def test_nocodes_modes_parse_and_get_their_own_ratios():
    """``MODE+nocodes`` runs MODE with the code comparison off on the same store: its label parses (with or without
    ``+margin`` and a read-next choice), a repeated or unknown part is refused, and the summary reports it over MODE
    and over bf16 beside the plain fp4_hints over bf16."""
    bt = benchmarks.load("benchmark_trainer")
    assert bt._label("fp4_hints") == ("fp4_hints", False, "", True)
    assert bt._label("fp4_hints+nocodes:process") == ("fp4_hints", False, "process", False)
    assert bt._label("fp4_hints+margin+nocodes") == ("fp4_hints", True, "", False)
    for bad in ("fp4_hints+foo", "fp4_hints+nocodes+nocodes"):
        with pytest.raises(ValueError, match="after '\\+'"):
            bt._label(bad)
    codes = _rep([2.0, 0.50, 0.30, 0.30, 0.30])
    nocodes = _rep([2.0, 0.40, 0.24, 0.24, 0.24])
    bf16 = _rep([1.0, 0.30, 0.20, 0.20, 0.20])
    s = bt._summary({"fp4_hints": [codes] * 3, "fp4_hints+nocodes": [nocodes] * 3, "bf16": [bf16] * 3})
    assert s["fp4_hints_nocodes_over_codes_step_s_unmeasured"] == pytest.approx(0.24 / 0.30)
    assert s["fp4_hints_nocodes_over_bf16_step_s_unmeasured"] == pytest.approx(0.24 / 0.20)
    assert s["fp4_hints_over_bf16_step_s_unmeasured"] == pytest.approx(0.30 / 0.20)
    assert s["fp4_hints_nocodes_over_bf16_step_s_default_mean"] == pytest.approx((0.40 + 3 * 0.24) / (0.30 + 3 * 0.20))
