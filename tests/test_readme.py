"""The README's Python examples run as written, twice in a row (a snippet that writes a fixed path failed the
second time), in a fresh interpreter each, so docs and behaviour cannot drift apart."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_has_examples():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs_twice(index, tmp_path):
    code = BLOCKS[index]
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                             cwd=tmp_path)
        assert out.returncode == 0, f"README example {index} failed:\n{code}\n{out.stderr[-3000:]}"
