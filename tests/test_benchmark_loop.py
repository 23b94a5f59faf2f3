"""benchmarks/benchmark_loop.py's ``MODE+nocodes``: the loop run without the rollout's codes (what the trainer's code
comparison costs the loop), a QAT mode of its own in the table, refused with any other suffix."""

from __future__ import annotations

import argparse

import pytest
from helpers import benchmarks


def test_nocodes_mode_turns_off_the_rollouts_codes_only():
    bl = benchmarks.load("benchmark_loop")
    assert bl._qat_mode("fp4_hints") == ("fp4_hints", True)
    assert bl._qat_mode("fp4_hints+nocodes") == ("fp4_hints", False)
    with pytest.raises(ValueError, match="only be 'nocodes'"):
        bl._qat_mode("fp4_hints+margin")
    args = argparse.Namespace(smoke=True, device="cpu", gpus=None, steps=None, groups=None, response_len=None,
                              lr=None, micro_batch_tokens=None, threads=1, read_ahead_mb=None, time_phases=None,
                              replay_routes=False, measure_stale_every=1)
    s = bl._settings(args)
    with_codes = bl._config(args, s, "fp4_hints", 0, "/tmp/a")
    without = bl._config(args, s, "fp4_hints+nocodes", 0, "/tmp/a")
    assert (with_codes.mode, with_codes.record_codes) == ("fp4_hints", True)
    assert (without.mode, without.record_codes) == ("fp4_hints", False)
    assert {k: v for k, v in vars(without).items() if k != "record_codes"} == \
        {k: v for k, v in vars(with_codes).items() if k != "record_codes"}
